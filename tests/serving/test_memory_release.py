"""Tier 2: the server gives back its KV cache while paused (what a colocated trainer's step
needs) and generates the same tokens after taking it back; its cap on a shared GPU's memory."""

from __future__ import annotations

import pytest

from areal.serving.sampling import SamplingParams
from tests.serving.conftest import hf_greedy

PROMPT = [5, 17, 99, 200, 3]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


def test_release_needs_a_pause_and_gives_back_the_whole_cache(tiny_model_dir, hf_model):
    from areal.serving.generator import Generator

    gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=4).start()
    try:
        assert gen.generate([PROMPT], GREEDY)[0].output_ids == hf_greedy(hf_model, PROMPT, 24)
        with pytest.raises(ValueError, match="needs a paused server"):
            gen.release_memory()
        tensors = (*gen.cache.k, *gen.cache.v, *gen.prefix.k, *gen.prefix.v)  # + prefix pool
        held = sum(t.numel() * t.element_size() for t in tensors)
        assert gen.prefix.k  # the prompt's blocks were cached
        gen.pause()
        assert gen.release_memory() == held > 0
        assert gen.cache.k == [] and gen.cache.capacity == 0 and gen.prefix.k == []
        gen.resume_memory()
        gen.resume()
        assert gen.cache.capacity > 0
        assert gen.generate([PROMPT], GREEDY)[0].output_ids == hf_greedy(hf_model, PROMPT, 24)
        gen.pause()  # resumed without resume_memory: the next step allocates the cache itself
        gen.release_memory()
        gen.resume()
        assert gen.generate([PROMPT], GREEDY)[0].output_ids == hf_greedy(hf_model, PROMPT, 24)
    finally:
        gen.shutdown()


@pytest.mark.parametrize("device, index", [("cuda", 3), ("cuda:1", 1)])
def test_the_memory_cap_names_the_gpu_by_index_as_torch_requires(monkeypatch, device, index):
    """A colocated server says ``cuda``; torch's cap takes an index only (it raised on the first
    GPU run). Hand-set: the current device is 3."""
    import torch

    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import gpu_memory_cap

    calls = []

    def cap(fraction, device):  # torch's argument check (_get_device_index), then the call
        if isinstance(device, torch.device) and device.index is not None:
            device = device.index
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index, got {device}")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    cfg = GenerationServerConfig(model_path="m", device=device, gpu_memory_fraction=0.3)
    with gpu_memory_cap(cfg):
        pass
    assert calls == [(0.3, index)]
