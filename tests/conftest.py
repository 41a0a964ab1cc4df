"""Shared fixtures: a tiny model built once per test session, a run context over it, a Ray head;
the GPU tier skips without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before torch loads OpenMP (which reads it once), and inherited by every process a test starts:
# OpenMP threads waiting for work sleep instead of spinning. Two pytest workers and the processes
# they start share 2 cores; a spinning thread holds a core the others need (a small training loop
# took 36 s instead of 1.4 s beside a busy neighbour). Results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
# Built CPU kernels (areal/serving/cpu_attention.py) kept in the checkout, not the home directory:
# the suite's ~100 servers build the decode-attention kernel once (a clean clone: once per run)
os.environ.setdefault(
    "AREAL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "areal")
)
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# `make test` runs on two pytest-xdist workers (`-n 2`): most tier-2 tests wait on processes
# they started, so two at a time take about half the wall time on 2 cores. The scheduler below
# hands out whole modules (a module's fixtures are made once) and whole groups of modules: the
# modules of one group run on one worker, one after another, because they share a session
# fixture or would crowd the machine together.
SERIAL_GROUPS = {
    # Ray clusters of several worker actors each, one at a time: the session's ray_head and the
    # Core runs that start a local instance of their own (besides core_async_recorded's, below)
    "ray": (
        "core/test_async_ppo.py",
        "core/test_core_sft.py",
        "core/test_health_timeout.py",
        "core/test_ray_pp.py",
        "core/test_ray_realloc.py",
        "core/test_ray_tp.py",
        "core/test_ray_worker.py",
        "core/test_rollout_side.py",
        "core/test_sync_ppo.py",
        "core/test_sync_ppo_layouts.py",
        "examples/test_distill_end_to_end.py",
        "launcher/test_ray_launcher.py",
        "utils/test_name_resolve.py",
    ),
    # the session fixture async_grpo_reference: one async GRPO run these modules compare against
    # (test_viewer shows it); test_viewer and test_core_record share core_async_recorded, a Core
    # run on a local Ray instance (the one Ray instance of this group)
    "grpo-reference": (
        "examples/test_end_to_end.py",
        "examples/test_lora_grpo.py",
        "examples/test_resume.py",
        "examples/test_viewer.py",
        "examples/test_core_record.py",
    ),
    # vLLM-CPU servers (GiBs of KV cache each); test_docs runs docs/vllm.md's blocks. The vLLM
    # tests run last in the group (below) and wait for the venv `make test` builds beside them
    # (~3-4 minutes from its start): test_local_launcher (~2 minutes, no vLLM) is in the group
    # so that its worker runs it meanwhile instead of waiting (~1 minute of waiting saved)
    "vllm": (
        "rollout/test_vllm_real.py",
        "examples/test_vllm_grpo.py",
        "test_docs.py",
        "launcher/test_local_launcher.py",
    ),
    # the sandbox tests count the processes of the sandbox's unprivileged uid
    "sandbox": (
        "reward/test_agent_sandbox.py",
        "reward/test_sandbox.py",
        "reward/test_sandbox_escapes.py",
    ),
}
GROUP_OF = {module: group for group, modules in SERIAL_GROUPS.items() for module in modules}


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for ``-n N``: its work units are a module, or a group of
    :data:`SERIAL_GROUPS` (largest units first). xdist's own ``--dist loadgroup`` marks cannot
    do it under pytest 9.2, which no longer reads the node id xdist rewrites."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].removeprefix("tests/")
            return GROUP_OF.get(module, module)

    return ModuleGroupScheduling(config, log)


def _waits_for_the_vllm_venv(item) -> bool:
    module = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return GROUP_OF.get(module) == "vllm" and "vllm" in item.nodeid


def pytest_collection_modifyitems(config, items):
    # The vLLM tests wait for the venv `make test` builds beside them (~4 minutes from its
    # start): last in their group (and test_docs' vLLM blocks last in it), so the group's worker
    # runs the other docs blocks and test_local_launcher meanwhile instead of waiting first.
    items.sort(key=_waits_for_the_vllm_venv)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="tier 3: needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A ~3M-parameter Qwen2-style HF model dir (random weights, seed 0)."""
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """The tiny model (seed 0) of each family the embedded server serves, by ``model_type``:
    qwen2 is ``tiny_model_dir``; qwen3, llama and qwen3_moe are built here (~1 s each)."""
    from areal.utils.tiny_model import build_tiny_model

    dirs = {"qwen2": tiny_model_dir}
    for family in ("qwen3", "llama", "qwen3_moe"):
        out = tmp_path_factory.mktemp(f"tiny_{family}")
        dirs[family] = str(build_tiny_model(out, size="tiny", seed=0, family=family))
    return dirs


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_head():
    """A real local Ray cluster (6 CPUs), stopped at the end of the session; skips with the
    exact reason when Ray is missing or cannot start. The "ray" group's modules (one worker, one
    after another) share it: the tests that drive Ray themselves, and the Core runs that join it
    (``cluster_runs``) instead of starting an instance of their own (a start and a stop take
    ~5-10 s here). Its workers find the reward functions those runs name (tests/core on their
    PYTHONPATH, which a joined cluster's workers take from the cluster, not from the run)."""
    from tests.daemons import DaemonUnavailable, start_ray_head

    rewards = Path(__file__).resolve().parent / "core"
    try:
        head = start_ray_head(num_cpus=6, env={"PYTHONPATH": str(rewards)})
    except DaemonUnavailable as e:
        pytest.skip(str(e))
    yield head
    head.stop()


@pytest.fixture
def make_run(tmp_path, tiny_model_dir):
    """``make_run(*overrides)`` -> a :class:`Run` over RUN_DIR=tmp_path/e/t (recover.mode=resume);
    the log files its ``init_run`` opened are closed at teardown."""
    import logging

    from areal.api.config import SFTConfig, load_config
    from areal.runtime.run import init_run

    def make(*overrides: str):
        base = [
            f"fileroot={tmp_path}",
            "experiment_name=e",
            "trial_name=t",
            "recover.mode=resume",
            f"model.path={tiny_model_dir}",
            "cluster.n_servers=0",
            "train_dataset.type=sft",
            "stats_logger.console=false",
        ]
        return init_run(load_config(SFTConfig, [*base, *overrides]), tiny_model_dir)

    yield make
    root = logging.getLogger("areal")
    for handler in [h for h in root.handlers if str(tmp_path) in getattr(h, "baseFilename", "")]:
        root.removeHandler(handler)
        handler.close()
