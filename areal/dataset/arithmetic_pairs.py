"""Preference pairs sampled from a model on the arithmetic task: the offline data of the DPO demo.

For every problem of a split (:mod:`areal.dataset.arithmetic`) the model samples ``n_samples``
answers (:func:`areal.serving.sampling.sample_continuations`: the HF model with its KV cache,
each prompt prefilled once; plain temperature sampling, no top-k/top-p: the distribution our
generation server samples from); :func:`is_right` grades each as the math reward does, an answer
that is no plain number being wrong. A problem with
at least one right and one wrong answer gives up to ``pairs_per_prompt`` pairs (a right answer
chosen over a wrong one, distinct answers, drawn with the seed); problems the model always or
never solves give none. The pairs are written in the preference JSONL format of
:mod:`areal.dataset.preference` (``id``, ``messages``, ``chosen``, ``rejected``, ``reference``).

``areal dpo-pairs --model SFT_DIR --out DIR`` writes ``DIR/train.jsonl`` and ``DIR/test.jsonl``
(disjoint problems, by the arithmetic split hash) and ``DIR/summary.json``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal.api.config.data import ArithmeticConfig
from areal.api.config.loader import param
from areal.dataset.arithmetic import INSTRUCTION, make_arithmetic
from areal.dataset.chat import prompt_ids
from areal.reward.math import extract_answer, to_number
from areal.serving.sampling import sample_continuations


def _demo_task() -> ArithmeticConfig:
    """The task of examples/sft_arithmetic.yaml: two-digit addition, 2000 + 200 problems."""
    return ArithmeticConfig(min_digits=2, max_digits=2, operators="+", n_train=2000, n_test=200)


@dataclass(frozen=True)
class ArithmeticPairsConfig:
    """``areal dpo-pairs``: preference pairs sampled from a model on synthetic arithmetic."""

    model: str = param("", help="HF model dir to sample from (the SFT model).")
    out: str = param("", help="Output dir: train.jsonl, test.jsonl, summary.json.")
    arithmetic: ArithmeticConfig = param(
        factory=_demo_task, help="The problems (defaults: the SFT demo's task)."
    )
    n_samples: int = param(8, ge=2, help="Answers sampled per problem.")
    temperature: float = param(1.0, gt=0, help="Sampling temperature.")
    max_new_tokens: int = param(6, ge=1, help="Most tokens per answer.")
    pairs_per_prompt: int = param(2, ge=1, help="Most (right, wrong) pairs kept per problem.")
    batch_size: int = param(64, ge=1, help="Problems per generate call.")
    seed: int = param(
        1,
        ge=0,
        help="Seed of the problem stream, sampling and pairing (1: the demo runs' seed, "
        "so the problems are those SFT trained on and the held-out ones they evaluate on).",
    )

    def check(self):
        for name in ("model", "out"):
            if not getattr(self, name):
                yield f"{name}: empty; pass --{name} DIR"


def sample_answers(
    model: Any, tokenizer: Any, items: list[dict[str, Any]], cfg: ArithmeticPairsConfig
) -> list[list[str]]:
    """``cfg.n_samples`` decoded answers per item (up to the end-of-turn token)."""
    answers: list[list[str]] = []
    for start in range(0, len(items), cfg.batch_size):
        prompts = [
            prompt_ids(tokenizer, it["messages"]) for it in items[start : start + cfg.batch_size]
        ]
        rows = sample_continuations(
            model,
            prompts,
            cfg.n_samples,
            cfg.temperature,
            cfg.max_new_tokens,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        answers += [texts[k : k + cfg.n_samples] for k in range(0, len(texts), cfg.n_samples)]
    return answers


def is_right(answer: str, reference: str) -> bool:
    """Whether a sampled answer's number equals the integer reference: the math reward's
    answer extraction and exact comparison, where an answer that is no plain number is wrong
    (the prompt asks for the number only), so no answer costs a math-verify call."""
    extracted = extract_answer(answer)
    number = to_number(extracted) if extracted is not None else None
    return number is not None and number == int(reference)


def make_pairs(
    item: dict[str, Any], answers: list[str], pairs_per_prompt: int, rng: random.Random
) -> list[dict[str, Any]]:
    """Up to ``pairs_per_prompt`` (right chosen, wrong rejected) rows from one item's answers."""
    right = sorted({a for a in answers if is_right(a, item["reference"])})
    wrong = sorted({a for a in answers if a not in right})
    if not right or not wrong:
        return []
    rng.shuffle(right)
    rng.shuffle(wrong)
    n = min(pairs_per_prompt, max(len(right), len(wrong)))
    return [
        {
            "id": f"{item['id']}-p{k}",
            "messages": item["messages"],
            "chosen": right[k % len(right)],
            "rejected": wrong[k % len(wrong)],
            "reference": item["reference"],
        }
        for k in range(n)
    ]


def build_pairs(
    cfg: ArithmeticPairsConfig, split: str, model: Any, tokenizer: Any
) -> tuple[list[dict], dict]:
    """(pair rows, stats) of one split: sampled accuracy, problems with a pair, pairs."""
    items = make_arithmetic(cfg.arithmetic, split, cfg.seed, INSTRUCTION)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        answers = sample_answers(model, tokenizer, items, cfg)
    rng = random.Random(f"areal-pairs-{cfg.seed}-{split}")
    rows, n_right, n_paired = [], 0, 0
    for item, group in zip(items, answers):
        n_right += sum(is_right(a, item["reference"]) for a in group)
        pairs = make_pairs(item, group, cfg.pairs_per_prompt, rng)
        n_paired += bool(pairs)
        rows += pairs
    stats = {
        "problems": len(items),
        "sample_accuracy": n_right / (len(items) * cfg.n_samples),
        "problems_with_pairs": n_paired,
        "pairs": len(rows),
    }
    return rows, stats


def write_arithmetic_pairs(cfg: ArithmeticPairsConfig) -> dict[str, Any]:
    """Sample both splits from ``cfg.model`` and write the JSONL files; the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": cfg.model}
    for split in ("train", "test"):
        rows, stats = build_pairs(cfg, split, model, tokenizer)
        if not rows:
            raise RuntimeError(
                f"{split}: no problem had both a right and a wrong answer among "
                f"{cfg.n_samples} samples (accuracy {stats['sample_accuracy']:.3f}); "
                "raise n_samples or use a model that sometimes answers right"
            )
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        summary[split] = stats
    summary["seconds"] = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
