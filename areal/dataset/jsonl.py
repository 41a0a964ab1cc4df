"""Generic JSONL datasets for RL, SFT and reward-model training.

Accepted rows (extra fields are kept on the item):

* ``rl``:  ``prompt`` (str) or ``messages`` (chat list), and ``reference`` or ``answer``.
* ``sft``: ``prompt`` + ``completion``, or ``messages`` ending with an assistant message.
* ``rw``:  ``prompt`` + ``chosen`` + ``rejected``.

An ``id`` field is used when present, else ``<file stem>-<line number>``. A bad row raises
:class:`DatasetError` naming the file, the line and the field, and what to write instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A dataset file or row that cannot be used, with where and how to fix it."""


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line; bad JSON raises with the line number."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); one object per line"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            yield lineno, row


def _need(row: dict, where: str, *alternatives: str) -> str:
    """The first of ``alternatives`` present in ``row`` (its name), or a DatasetError."""
    for name in alternatives:
        if name in row:
            return name
    wanted = " or ".join(repr(a) for a in alternatives)
    raise DatasetError(f"{where}: missing field {wanted}; row has {sorted(row)}")


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: field 'messages' must be a non-empty list of chat messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise DatasetError(
                f"{where}: field 'messages[{k}]' must be {{'role': ..., 'content': ...}}, got {m!r}"
            )
    return messages


def _text_field(row: dict, name: str, where: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def rl_item(row: dict, where: str, default_id: str) -> dict[str, Any]:
    """An RL item from a row with prompt|messages and reference|answer."""
    prompt_field = _need(row, where, "messages", "prompt")
    ref_field = _need(row, where, "reference", "answer")
    if prompt_field == "messages":
        messages = _check_messages(row["messages"], where)
    else:
        messages = [{"role": "user", "content": _text_field(row, "prompt", where)}]
    extras = {k: v for k, v in row.items() if k not in ("messages", "prompt", ref_field)}
    return {**extras, "id": str(row.get("id", default_id)), "messages": messages,
            "reference": row[ref_field]}  # fmt: skip


def sft_item(row: dict, where: str, default_id: str) -> dict[str, Any]:
    """An SFT item: messages ending with the assistant's reply."""
    field = _need(row, where, "messages", "prompt")
    if field == "messages":
        messages = _check_messages(row["messages"], where)
        if messages[-1]["role"] != "assistant":
            raise DatasetError(
                f"{where}: field 'messages' must end with an assistant message (the target), "
                f"ends with role {messages[-1]['role']!r}"
            )
    else:
        _need(row, where, "completion")
        messages = [
            {"role": "user", "content": _text_field(row, "prompt", where)},
            {"role": "assistant", "content": _text_field(row, "completion", where)},
        ]
    return {"id": str(row.get("id", default_id)), "messages": messages}


def rw_item(row: dict, where: str, default_id: str) -> dict[str, Any]:
    """A preference pair: prompt, chosen and rejected replies."""
    for name in ("prompt", "chosen", "rejected"):
        _need(row, where, name)
        _text_field(row, name, where)
    return {"id": str(row.get("id", default_id)), "prompt": row["prompt"],
            "chosen": row["chosen"], "rejected": row["rejected"]}  # fmt: skip


_BUILDERS = {"rl": rl_item, "sft": sft_item, "rw": rw_item}


def load_jsonl(path: str | Path, type: str) -> list[dict[str, Any]]:
    """Every row of a JSONL file as an item of ``type`` ('rl' | 'sft' | 'rw')."""
    if type not in _BUILDERS:
        raise DatasetError(f"dataset type {type!r} is not one of {sorted(_BUILDERS)}")
    path = Path(path)
    build = _BUILDERS[type]
    items = [
        build(row, f"{path}:{lineno}", f"{path.stem}-{lineno}") for lineno, row in read_jsonl(path)
    ]
    check_unique_ids(items, str(path))
    return items


def check_unique_ids(items: list[dict[str, Any]], source: str) -> None:
    """Raise if two items share an id (ids key recover state and logs)."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise DatasetError(
                f"{source}: duplicate id {item['id']!r}; ids must be unique (used for recover)"
            )
        seen.add(item["id"])
