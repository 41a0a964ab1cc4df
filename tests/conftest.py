"""Shared fixtures: a tiny model built once per test session, a run context over it, a Ray head;
the GPU tier skips without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
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
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def ray_head():
    """A real local Ray cluster (6 CPUs) shared by one module's Ray tests, stopped after it;
    skips with the exact reason when Ray is missing or cannot start."""
    from tests.daemons import DaemonUnavailable, start_ray_head

    try:
        head = start_ray_head(num_cpus=6)
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
