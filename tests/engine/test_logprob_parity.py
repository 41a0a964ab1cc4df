"""The contract between rollout and training: the generator's behaviour logprobs equal the
training engine's ``compute_logp`` on the same tokens and weights (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from test_fsdp import world_mesh

from areal.api.config import PPOActorConfig
from areal.engine.ppo import PPOActor
from areal.serving.generator import Generator
from areal.serving.sampling import SamplingParams
from areal.utils.batch import PackedBatch


@pytest.fixture(scope="module")
def generator(tiny_model_dir):
    gen = Generator.from_pretrained(tiny_model_dir).start()
    yield gen
    gen.shutdown()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_server_logprobs_equal_trainer_compute_logp(tiny_model_dir, generator, temperature):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    results = generator.generate(prompts, params)
    actor = PPOActor(PPOActorConfig(path=tiny_model_dir), world_mesh(), temperature=temperature)
    actor.initialize(None)
    try:
        batch = PackedBatch.from_sequences(
            {"input_ids": [r.input_ids + r.output_ids for r in results]}
        )
        logp = actor.compute_logp(batch)[0]["logp"]  # [T]
        for i, r in enumerate(results):
            start = int(batch.cu_seqlens[i]) + len(r.input_ids)
            trainer = logp[start : start + len(r.output_ids)]
            server = torch.tensor(r.output_logprobs)
            assert len(r.output_ids) == 12
            torch.testing.assert_close(trainer, server, atol=1e-4, rtol=0)
    finally:
        actor.destroy()
