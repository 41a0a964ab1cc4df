"""A tinker-cookbook recipe, unchanged, against `areal tinker serve` (tier 2, CPU): the cookbook's
``recipes/sl_basic.py`` (its SFT loop: ``supervised/train.py``) run as ``python -m`` from the
cookbook's own venv (tests/tinker/cookbook_env.py), for two steps on the tiny Llama-family model.

No hub access: the recipe's NoRobots dataset is swapped, on its command line, for the
conversations file the cookbook ships (``example_data/conversations.jsonl``, the swap the recipe
itself suggests); the cookbook picks a renderer by model name and loads the tokenizer of that
name, so the service answers to ``meta-llama/Llama-3.2-1B`` (``model_name=``) and the tiny model
lies in ``./meta-llama/Llama-3.2-1B`` of the recipe's working dir, where the cookbook's
tokenizer loader looks first (docs/tinker.md, "tinker-cookbook")."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from areal.utils.tiny_model import build_tiny_model
from tests.tinker import cookbook_env
from tests.tinker.test_tinker_service import KEY, Service

pytestmark = pytest.mark.slow
NAME = "meta-llama/Llama-3.2-1B"  # a cookbook-known name (renderer role_colon); the tiny model here
STEPS, BATCH = 2, 4


def recipe_argv(service_url: str, log_path: str, data: str) -> list[str]:
    """sl_basic's command line: base_url, model name, a short run, and the local dataset."""
    common = "dataset_builder.common_config"
    return [
        "-m",
        "tinker_cookbook.recipes.sl_basic",
        f"base_url={service_url}",
        f"model_name={NAME}",
        f"log_path={log_path}",
        f"max_steps={STEPS}",
        "dataset_builder=FromConversationFileBuilder",
        f"dataset_builder.file_path={data}",
        f"{common}.model_name_for_tokenizer={NAME}",
        f"{common}.renderer_name=role_colon",  # sl_basic's own values from here on, but the batch
        f"{common}.max_length=32768",
        f"{common}.batch_size={BATCH}",
        f"{common}.train_on_what=all_assistant_messages",
    ]


def test_sl_basic_recipe_trains_through_the_service(tmp_path):
    python, reason = cookbook_env.ensure()
    if python is None:
        pytest.skip(reason)
    data = subprocess.run(
        [str(python), "-c", "import tinker_cookbook as t; print(t.__path__[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    work = tmp_path / "work"
    model = build_tiny_model(work / NAME, family="llama")
    service = Service(str(model), tmp_path / "root", f"model_name={NAME}", "max_batch_tokens=32768")
    service.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(TINKER_API_KEY=KEY, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        argv = recipe_argv(
            service.url, str(tmp_path / "log"), f"{data}/example_data/conversations.jsonl"
        )
        run = subprocess.run(
            [str(python), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        service.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["num_sequences"] == BATCH and m["update_skipped:sum"] == 0, m
        # a random model over 259 byte tokens: the per-token NLL is near ln(259) = 5.56
        assert math.isfinite(m["train_mean_nll"]) and 4.5 < m["train_mean_nll"] < 6.5, m
    (final,) = [json.loads(line) for line in (tmp_path / "log" / "checkpoints.jsonl").open()]
    for key, kind in (("state_path", "weights"), ("sampler_path", "sampler_weights")):
        model_id, part, name = final[key].removeprefix("tinker://").split("/")
        assert part == kind and (tmp_path / "root" / model_id / kind / name).is_dir(), final
    assert (tmp_path / "root" / model_id / "sampler_weights" / "final" / "config.json").is_file()
