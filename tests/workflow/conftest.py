"""Test-only inference engines (the real generation server is not used by these tests).

* ``TinyHFEngine``: the tiny HF model, token-by-token sampling with logprobs from the same
  forward pass (temperature-scaled log-softmax), every token stamped with the engine's version.
* ``ScriptedEngine``: replies with pre-written texts (then EOS), logprob -0.5 per token, and
  bumps its version after every call; it records the requests it saw.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal.api.config.reward import RewardConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse
from areal.reward.math import math_reward
from areal.reward.runner import RewardRunner


class _VersionedEngine(InferenceEngine):
    def __init__(self, version: int = 0):
        self.version = version

    def update_weights(self, meta) -> None:
        self.version = meta.version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class TinyHFEngine(_VersionedEngine):
    """Samples from the tiny model on CPU (no KV cache: prompts and outputs are short)."""

    def __init__(self, model_dir: str, eos_id: int, version: int = 0):
        from transformers import AutoModelForCausalLM

        super().__init__(version)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.eos_id = eos_id

    @torch.no_grad()
    def _generate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        gen = torch.Generator().manual_seed(
            req.seed if req.seed is not None else hash(req.rid) % 2**31
        )
        ids = list(req.input_ids)
        out, logps = [], []
        stop = "length"
        for _ in range(g.max_new_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1]  # [V]
            logp = torch.log_softmax(logits / g.temperature, dim=-1)
            tok = (
                int(logp.argmax())
                if g.greedy
                else int(torch.multinomial(logp.exp(), 1, generator=gen))
            )
            out.append(tok)
            logps.append(float(logp[tok]))
            ids.append(tok)
            if tok == self.eos_id or tok in g.stop_token_ids:
                stop = "stop"
                break
        return ModelResponse(list(req.input_ids), out, logps, [self.version] * len(out), stop)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await asyncio.sleep(0)
        return self._generate(req)


class ScriptedEngine(_VersionedEngine):
    """Replies with ``replies[i]`` (+ EOS) to the i-th request; version += 1 after each."""

    def __init__(self, tokenizer, replies: list[str], version: int = 0):
        super().__init__(version)
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await asyncio.sleep(0)
        text = self.replies[len(self.requests)]
        self.requests.append(req)
        out = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(self.tokenizer.eos_token_id)
        resp = ModelResponse(
            list(req.input_ids), out, [-0.5] * len(out), [self.version] * len(out), "stop"
        )
        self.version += 1
        return resp


@pytest.fixture(scope="module")
def math_runner():
    with RewardRunner(math_reward, RewardConfig(n_workers=2)) as runner:
        yield runner


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir, tiny_tokenizer):
    return TinyHFEngine(tiny_model_dir, tiny_tokenizer.eos_token_id, version=5)


@pytest.fixture
def scripted(tiny_tokenizer):
    """Factory: ``scripted(replies, version=0) -> ScriptedEngine``."""
    return lambda replies, version=0: ScriptedEngine(tiny_tokenizer, replies, version)
