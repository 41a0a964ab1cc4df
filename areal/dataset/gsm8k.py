"""GSM8K: grade-school math word problems with a worked solution ending in ``#### <answer>``.

Sources, tried in order: a local ``.jsonl`` or ``.parquet`` file; a directory holding
``<split>.jsonl`` or ``<split>.parquet``; otherwise a Hugging Face dataset id (e.g.
``openai/gsm8k``, config ``main``) loaded through ``datasets`` (needs the network or a cache).
The whole solution is kept as ``reference``: :func:`areal.reward.math.math_reward` reads the
number after ``####``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal.dataset.jsonl import DatasetError, read_jsonl

INSTRUCTION = (
    "Solve the problem step by step, then give the final answer on the last line as "
    "'#### <number>'."
)


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    yield from enumerate(table, start=1)


def _hub_rows(name: str, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    import datasets

    try:
        table = datasets.load_dataset(name, "main", split=split)
    except Exception as e:  # offline, unknown id, unknown split: say which and how to fix
        raise DatasetError(
            f"gsm8k: {name!r} is not a local file or directory and loading it from the Hugging "
            f"Face hub failed ({type(e).__name__}: {e}); pass a local .jsonl/.parquet path"
        ) from e
    yield from enumerate(table, start=1)


def gsm8k_rows(path: str, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, raw row) from whichever source ``path`` names (see module docstring)."""
    p = Path(path)
    if p.is_dir():
        for suffix in (".jsonl", ".parquet"):
            if (p / f"{split}{suffix}").is_file():
                return gsm8k_rows(str(p / f"{split}{suffix}"), split)
        raise DatasetError(f"{p}: no {split}.jsonl or {split}.parquet in this directory")
    if p.suffix == ".jsonl":
        return read_jsonl(p)
    if p.suffix == ".parquet":
        if not p.is_file():
            raise DatasetError(f"{p}: no such file; check the dataset path")
        return _parquet_rows(p)
    return _hub_rows(path, split)


def load_gsm8k(path: str, split: str = "train", instruction: str = "") -> list[dict[str, Any]]:
    """GSM8K as RL items: the question plus an instruction; the full solution as reference."""
    instruction = instruction or INSTRUCTION
    items = []
    for lineno, row in gsm8k_rows(path, split):
        for name in ("question", "answer"):
            if not isinstance(row.get(name), str):
                raise DatasetError(
                    f"{path}:{lineno}: GSM8K field {name!r} missing or not a string; rows need "
                    "'question' and 'answer' (a solution ending in '#### <number>')"
                )
        items.append(
            {
                "id": f"gsm8k-{split}-{lineno:05d}",
                "messages": [{"role": "user", "content": f"{row['question']}\n{instruction}"}],
                "reference": row["answer"],
            }
        )
    return items
