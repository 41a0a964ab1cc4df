"""launcher/common.py: which module a script's ``CONFIG`` is imported from (tier 1), and that a
launch's start-up stays light: it, and the processes Core starts per run, import no more than
they use (tier 2, one fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from areal.launcher.common import config_import
from areal.launcher.local import GPU_DRIVER_NODES

REPO = Path(__file__).resolve().parents[2]


def test_config_imported_by_name_is_found_with_its_module():
    assert config_import("from areal.api.config import GRPOConfig\nCONFIG = GRPOConfig\n") == (
        "areal.api.config",
        "GRPOConfig",
    )
    assert config_import("from pkg.mod import C as D\nimport os\nCONFIG = D\n") == ("pkg.mod", "C")


def test_any_other_config_makes_the_script_itself_imported():
    assert config_import("class C: ...\nCONFIG = C\n") is None  # defined in the script
    assert config_import("import pkg\nCONFIG = pkg.C\n") is None  # not a bare name
    assert config_import("from a import C\nclass C(C): ...\nCONFIG = C\n") is None  # rebound
    assert config_import("from a import A, B\nimport os\nCONFIG = A if os.environ else B\n") is None
    assert config_import("from . import C\nCONFIG = C\n") is None  # relative: the script's own
    assert config_import("from a import C\nCONFIG = C\nCONFIG = C\n") is None


def test_every_entry_script_names_its_config_by_import():
    scripts = [*REPO.glob("examples/*.py"), REPO / "areal/core/sync_ppo.py"]
    scripts += [REPO / "areal/core/async_ppo.py", REPO / "areal/core/replay.py"]
    with_config = [p for p in scripts if "\nCONFIG = " in p.read_text()]
    assert len(with_config) >= 7
    assert [p.name for p in with_config if config_import(p.read_text()) is None] == []


def test_a_config_dataclass_the_script_defines_loads_with_postponed_annotations(tmp_path):
    """dataclasses resolves ``from __future__ import annotations`` through sys.modules: the
    script's module must be there while it runs (as ``python SCRIPT`` has ``__main__``)."""
    from areal.launcher.common import load_script_config_class

    script = tmp_path / "own_config.py"
    script.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class MyConfig:\n"
        "    lr: float = 0.5\n"
        "CONFIG = MyConfig\n"
    )
    assert load_script_config_class(script)().lr == 0.5


PROBE = """
import json, sys
from areal.launcher.common import load_script_config_class
from areal.launcher.local import gpu_count
import areal.core.config
for script in sys.argv[1:]:
    load_script_config_class(script)
gpu_count()
launcher = sorted(m for m in ("torch", "transformers", "ray") if m in sys.modules)
import areal.core.rollout_worker, areal.core.async_ppo, areal.runtime.rl
workers = sorted(m for m in ("areal.engine.fsdp", "transformers.modeling_utils", "openai")
                 if m in sys.modules)
print(json.dumps([launcher, workers]))
"""


def test_a_launch_and_the_core_processes_import_only_what_they_use():
    """The launcher reads CONFIG and counts GPUs without torch, transformers or Ray (seconds of
    CPU per launch); a Core master and its rollout workers import neither the engines nor
    transformers' models, and no trainer imports the openai SDK before an agent's call."""
    scripts = [str(REPO / s) for s in ("examples/gsm8k_grpo.py", "areal/core/async_ppo.py")]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *scripts], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    launcher, workers = json.loads(out.stdout.strip().splitlines()[-1])
    gpu_driver = any(Path(dev).exists() for dev in GPU_DRIVER_NODES)
    assert launcher == (["torch"] if gpu_driver else []), launcher  # a GPU machine asks torch
    assert workers == [], workers
