"""Offline sampling from a Hugging Face model with its KV cache (``sample_continuations``, the
sampler of ``areal dpo-pairs``), against transformers' own greedy ``generate`` (tier 2)."""

from __future__ import annotations

import torch


def test_sampler_at_near_zero_temperature_equals_hf_greedy_generate(tiny_model_dir, tiny_tokenizer):
    """The sampler prefills each prompt once and repeats its KV cache per sample; with left
    padding of prompts of different lengths it must continue exactly as generate() does."""
    from transformers import AutoModelForCausalLM

    from areal.serving.sampling import sample_continuations

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = tiny_tokenizer
    prompts = [tok.encode(text) for text in ("1 + 2 = ?", "12 + 34 = ? Answer", "7")]
    rows = sample_continuations(model, prompts, 2, 1e-6, 5, tok.eos_token_id, tok.pad_token_id)
    for k, p in enumerate(prompts):
        greedy = model.generate(
            input_ids=torch.tensor([p]),
            do_sample=False,
            max_new_tokens=5,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        greedy = greedy[: greedy.index(tok.eos_token_id)] if tok.eos_token_id in greedy else greedy
        assert rows[2 * k] == rows[2 * k + 1] == greedy, (k, rows[2 * k], greedy)
