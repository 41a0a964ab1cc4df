"""Fixtures: an HF reference model, a started generator, and a second weight set."""

from __future__ import annotations

import shutil

import pytest
import torch

from areal.serving.cpu_attention import compiler

HAS_CC = shutil.which(compiler()) is not None
needs_cc = pytest.mark.skipif(
    not HAS_CC, reason="the compiled decode-attention kernel needs a C compiler ($CC, default cc)"
)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """Same architecture as tiny_model_dir, different weights (seed 1)."""
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model_b"), size="tiny", seed=1))


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=8).start()
    yield gen
    gen.shutdown()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: HF greedy generate on one prompt (no padding), generated ids only."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def hf_logprobs(
    model, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Reference: ``log_softmax(logits / T)`` of HF's forward at each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[
        :, 0
    ]
