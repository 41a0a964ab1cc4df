"""Seeded synthetic arithmetic problems with exact answers (the embedded demo's data).

A problem is ``a op b [op c ...]`` evaluated left to right (no precedence: the prompt says so
through its parentheses-free step form and the worked steps), e.g. ``"12 + 7 - 3"`` -> ``16``.
Which split a problem belongs to is a function of its text (a hash), so ``train`` and ``test``
never share a problem whatever the seed or sizes; within a split problems are distinct.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from areal.api.config.data import ArithmeticConfig

INSTRUCTION = "Answer with the number only."
_MAX_DRAWS_PER_ITEM = 200  # draws before concluding the problem space is too small


def _operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def draw_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int, list[str]] | None:
    """One problem: (expression, answer, worked steps), or None if it went negative when not
    allowed (the caller draws again)."""
    value = _operand(rng, cfg)
    expression = str(value)
    steps = []
    for _ in range(rng.randint(cfg.min_steps, cfg.max_steps)):
        op, rhs = rng.choice(cfg.operators), _operand(rng, cfg)
        new = value + rhs if op == "+" else value - rhs if op == "-" else value * rhs
        if new < 0 and not cfg.allow_negative:
            return None
        steps.append(f"{value} {op} {rhs} = {new}")
        expression += f" {op} {rhs}"
        value = new
    return expression, value, steps


def split_of(expression: str, test_percent: int) -> str:
    """'test' for ``test_percent`` percent of all problems (by a hash of the text), else 'train'."""
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:4], "big") % 100
    return "test" if bucket < test_percent else "train"


def make_item(index: int, split: str, expression: str, answer: int, steps: list[str],
              cfg: ArithmeticConfig, instruction: str) -> dict[str, Any]:  # fmt: skip
    """A dataset item (see areal.dataset for the schema)."""
    question = f"{expression} = ?"
    if instruction:
        question += f" {instruction}"
    item: dict[str, Any] = {
        "id": f"arith-{split}-{index:06d}",
        "messages": [{"role": "user", "content": question}],
        "reference": str(answer),
    }
    solution = "\n".join(steps + [f"The answer is {answer}."]) if cfg.worked_steps else str(answer)
    item["solution"] = solution
    return item


def make_arithmetic(
    cfg: ArithmeticConfig, split: str, seed: int = 0, instruction: str = INSTRUCTION
) -> list[dict[str, Any]]:
    """``cfg.n_train`` or ``cfg.n_test`` distinct problems of ``split`` ('train' | 'test')."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic split must be 'train' or 'test', got {split!r}")
    n = cfg.n_train if split == "train" else cfg.n_test
    # One stream per split, so changing n_test never changes the training problems.
    rng = random.Random(f"areal-arithmetic-{seed}-{split}")
    seen: set[str] = set()
    items: list[dict[str, Any]] = []
    draws = 0
    while len(items) < n:
        draws += 1
        if draws > _MAX_DRAWS_PER_ITEM * n:
            raise ValueError(
                f"arithmetic: found only {len(items)} distinct {split} problems of the {n} asked "
                f"for in {draws} draws; lower arithmetic.n_{split} or widen the problem space "
                "(max_digits, max_steps, operators)"
            )
        problem = draw_problem(rng, cfg)
        if problem is None:
            continue
        expression, answer, steps = problem
        if expression in seen or split_of(expression, cfg.test_percent) != split:
            continue
        seen.add(expression)
        items.append(make_item(len(items), split, expression, answer, steps, cfg, instruction))
    return items
