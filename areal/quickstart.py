"""``areal quickstart``: the embedded demo on one CPU machine with no network.

What it runs today: builds the tiny model, checks the tokenizer round-trip, and greedy-decodes a
few arithmetic prompts with the untrained model so the baseline is visible. The full pipeline
(SFT warm-up, asynchronous GRPO through the local launcher, before/after evaluation) replaces
this as the end-to-end issue lands.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from areal.utils.tiny_model import build_tiny_model, count_parameters

PROMPTS = [("3+4=", "7"), ("12+30=", "42"), ("9-5=", "4"), ("20+22=", "42")]


def run_quickstart(out: str | Path) -> int:
    """Build the tiny model under ``out`` and show what it can do; writes OUT/summary.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    out = Path(out)
    model_dir = build_tiny_model(out / "model", size="tiny", seed=0)
    print(f"tiny model: {count_parameters(model_dir):,} parameters at {model_dir}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sample = "spaces  tabs\tnewlines\n unicode é 日本"
    assert tok.decode(tok(sample)["input_ids"]) == sample, "tokenizer round-trip failed"
    print("tokenizer round-trips spaces, tabs, newlines and non-ASCII text")
    correct = 0
    for prompt, answer in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        correct += text.strip().startswith(answer)
        print(f"  {prompt!r} -> {text!r} (expected {answer})")
    summary = {"acc_untrained": correct / len(PROMPTS), "wall_seconds": time.time() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"untrained accuracy {summary['acc_untrained']:.2f}; summary at {out / 'summary.json'}")
    return 0
