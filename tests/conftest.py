"""Shared fixtures: a tiny model built once per test session; the GPU tier skips without CUDA."""

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
