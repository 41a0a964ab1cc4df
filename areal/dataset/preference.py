"""Preference pairs for DPO: a prompt and two replies, the chosen one preferred.

Accepted rows of a JSONL file (one object per line) or a Parquet file (how HF hub datasets are
stored); extra fields are kept on the item:

* ``prompt`` (str) or ``messages`` (chat list, the conversation so far), with ``chosen`` and
  ``rejected`` replies as strings (this repository's format);
* ``chosen`` / ``rejected`` as whole conversations, lists of chat messages ending with the
  assistant's reply (Anthropic HH as message lists, UltraFeedback-binarized): the messages
  before the reply are the prompt and must be the same on both sides; a ``prompt`` string next
  to them (UltraFeedback) must be the last user message of that prompt; a conversation of only
  the reply takes its prompt from ``prompt`` / ``messages``;
* ``chosen`` / ``rejected`` as raw Anthropic HH transcripts (``"\\n\\nHuman: ...\\n\\nAssistant:
  ..."``) with no ``prompt`` / ``messages``: parsed into messages as above.

Item: ``{"id", "messages" (the prompt), "chosen", "rejected"}`` (reply texts); with a tokenizer
also ``prompt_len`` and ``chosen_ids`` / ``rejected_ids``: the chat-templated prompt plus the
assistant header (the same ``prompt_len`` tokens on both sides), then the reply and its
end-of-turn tokens, which are the tokens DPO scores. A bad row raises :class:`DatasetError`
naming the file, the line and the field.

The built-in ``arithmetic`` path gives the fixed pairs of the reward-model demo (right answer
over a near miss); pairs sampled from a model come from :mod:`areal.dataset.arithmetic_pairs`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal.api.config.data import DatasetConfig
from areal.dataset.chat import Messages, chat_text, encode, prompt_ids
from areal.dataset.jsonl import DatasetError, check_unique_ids, read_jsonl
from areal.dataset.loader import ItemDataset, load_dataset

logger = logging.getLogger("areal.dataset")
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
_CONSUMED = ("prompt", "messages", "chosen", "rejected", "id")


def _messages(value: Any, where: str, field: str) -> Messages:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: field {field!r} must be a non-empty list of chat messages")
    for k, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not {"role", "content"} <= set(m)
            or not isinstance(m["content"], str)
        ):
            raise DatasetError(
                f"{where}: field '{field}[{k}]' must be {{'role': str, 'content': str}}, got {m!r}"
            )
    return value


def parse_hh_transcript(text: str, where: str, field: str) -> Messages:
    """Messages of an Anthropic HH transcript ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise DatasetError(
            f"{where}: field {field!r} is a string but there is no 'prompt' or 'messages' "
            "and it is not an HH transcript ('\\n\\nHuman: ...\\n\\nAssistant: ...'); "
            "add a 'prompt' field or give whole conversations as message lists"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[r], "content": c} for r, c in zip(parts[1::2], parts[2::2])]


def _split_reply(conversation: Messages, where: str, field: str) -> tuple[Messages, str]:
    if conversation[-1]["role"] != "assistant":
        raise DatasetError(
            f"{where}: field {field!r} must end with the assistant's reply, ends with "
            f"role {conversation[-1]['role']!r}"
        )
    return conversation[:-1], conversation[-1]["content"]


def _given_prompt(row: dict, where: str) -> Messages | None:
    if "messages" in row:
        return _messages(row["messages"], where, "messages")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise DatasetError(
                f"{where}: field 'prompt' must be a string, got {type(row['prompt']).__name__}"
            )
        return [{"role": "user", "content": row["prompt"]}]
    return None


def _side(row: dict, field: str, given: Messages | None, where: str) -> tuple[Messages, str]:
    """(prompt messages, reply text) of one side of a row."""
    value = row[field]
    if isinstance(value, str):
        if given is not None:
            return given, value
        return _split_reply(parse_hh_transcript(value, where, field), where, field)
    prefix, reply = _split_reply(_messages(value, where, field), where, field)
    if not prefix:
        if given is None:
            raise DatasetError(
                f"{where}: field {field!r} holds only the reply; add 'prompt' or 'messages'"
            )
        return given, reply
    if given is not None and "messages" not in row:
        users = [m["content"] for m in prefix if m["role"] == "user"]
        if not users or users[-1] != row["prompt"]:
            raise DatasetError(
                f"{where}: field 'prompt' differs from the last user message of {field!r}; "
                "the pair's prompt is ambiguous (drop 'prompt' or fix the row)"
            )
    return prefix, reply


def preference_item(row: dict, where: str, default_id: str) -> dict[str, Any]:
    """A pair item ``{"id", "messages", "chosen", "rejected", ...extras}`` from one row."""
    for field in ("chosen", "rejected"):
        if field not in row:
            raise DatasetError(f"{where}: missing field {field!r}; row has {sorted(row)}")
        if not isinstance(row[field], (str, list)):
            raise DatasetError(
                f"{where}: field {field!r} must be a string or a list of chat messages, "
                f"got {type(row[field]).__name__}"
            )
    given = _given_prompt(row, where)
    prompt, chosen = _side(row, "chosen", given, where)
    prompt_r, rejected = _side(row, "rejected", given, where)
    if prompt_r != prompt:
        raise DatasetError(
            f"{where}: fields 'chosen' and 'rejected' have different prompts (the "
            "messages before the reply); a pair must answer the same prompt"
        )
    extras = {k: v for k, v in row.items() if k not in _CONSUMED}
    return {
        **extras,
        "id": str(row.get("id", default_id)),
        "messages": prompt,
        "chosen": chosen,
        "rejected": rejected,
    }


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row) of a Parquet file (how HF hub datasets are stored)."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check the dataset path")
    yield from enumerate(pq.read_table(path).to_pylist(), start=1)


def load_preference_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSONL (or Parquet: ``.parquet``) file of preference pairs as an item;
    errors name the line (the row number for Parquet)."""
    path = Path(path)
    rows = _parquet_rows(path) if path.suffix == ".parquet" else read_jsonl(path)
    items = [preference_item(row, f"{path}:{n}", f"{path.stem}-{n}") for n, row in rows]
    check_unique_ids(items, str(path))
    return items


def tokenize_pair(item: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Add ``prompt_len``, ``chosen_ids`` and ``rejected_ids`` (see the module docstring)."""
    prompt = item["messages"]
    head = chat_text(tokenizer, prompt, add_generation_prompt=True)
    ids = prompt_ids(tokenizer, prompt)
    out = {**item, "prompt_len": len(ids)}
    for side in ("chosen", "rejected"):
        full = chat_text(tokenizer, prompt + [{"role": "assistant", "content": item[side]}], False)
        if not full.startswith(head):
            raise ValueError(
                "tokenize_pair: the chat template does not render the prompt as a prefix "
                "of the conversation; DPO needs a prefix-stable template such as ChatML"
            )
        out[f"{side}_ids"] = ids + encode(tokenizer, full[len(head) :])
    return out


def _raw_pairs(cfg: DatasetConfig, seed: int) -> list[dict[str, Any]]:
    if cfg.path == "arithmetic" and cfg.format in ("auto", "arithmetic"):
        plain = dataclasses.replace(cfg, size=None, max_length=None)
        return [
            preference_item(it, f"arithmetic:{it['id']}", it["id"])
            for it in load_dataset(plain, None, seed)
        ]
    if cfg.format == "jsonl" or (
        cfg.format == "auto" and cfg.path.endswith((".jsonl", ".parquet"))
    ):
        return load_preference_jsonl(cfg.path)
    raise DatasetError(
        f"dataset path {cfg.path!r} (format {cfg.format}): preference pairs come from a "
        ".jsonl or .parquet file or the built-in 'arithmetic' pairs; download HF datasets "
        "to one of those files"
    )


def load_preferences(cfg: DatasetConfig, tokenizer: Any = None, seed: int = 0) -> ItemDataset:
    """Pairs for ``cfg`` (first ``cfg.size``), tokenized when a tokenizer is given, with pairs
    whose longer side exceeds ``cfg.max_length`` tokens dropped (and the count logged)."""
    if cfg.type != "rw":
        raise DatasetError(
            f"{cfg.path}: preference pairs need type 'rw', got {cfg.type!r}; set type=rw"
        )
    items = _raw_pairs(cfg, seed)[: cfg.size]
    if tokenizer is not None:
        items = [tokenize_pair(item, tokenizer) for item in items]
        if cfg.max_length is not None:
            kept = [
                it
                for it in items
                if max(len(it["chosen_ids"]), len(it["rejected_ids"])) <= cfg.max_length
            ]
            if len(kept) < len(items):
                logger.info(
                    "%s: dropped %d of %d pairs longer than max_length=%d tokens",
                    cfg.path,
                    len(items) - len(kept),
                    len(items),
                    cfg.max_length,
                )
            items = kept
    if not items:
        raise DatasetError(f"{cfg.path} ({cfg.split}): no pairs left; check size and max_length")
    return ItemDataset(items, f"{cfg.path}:{cfg.split}")
