"""Build a dataset from a :class:`DatasetConfig` and a resumable, DP-sharded dataloader over it.

:class:`ShardedBatchSampler` draws a fresh permutation every epoch from ``seed + epoch``, cuts it
into global batches of ``cfg.batch_size`` and hands rank ``r`` the ``r``-th contiguous slice of
each. Its state is ``(epoch, batches yielded this epoch)``, saved and restored through
``StatefulDataLoader.state_dict()``, so a resumed loader yields exactly the remaining batches.
The loader runs with ``num_workers=0``: items are small dicts, and a prefetching worker would
put the sampler state ahead of what the trainer consumed.
"""

from __future__ import annotations

import itertools
import logging
import random
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from areal.api.config.data import DatasetConfig
from areal.dataset.arithmetic import INSTRUCTION as ARITHMETIC_INSTRUCTION
from areal.dataset.arithmetic import make_arithmetic
from areal.dataset.chat import prompt_ids, sft_tokens
from areal.dataset.gsm8k import load_gsm8k
from areal.dataset.jsonl import DatasetError, check_unique_ids, load_jsonl

logger = logging.getLogger("areal.dataset")


class ItemDataset(torch.utils.data.Dataset):
    """A map-style dataset of item dicts (see areal.dataset for the schema)."""

    def __init__(self, items: list[dict[str, Any]], name: str):
        self.items = items
        self.name = name

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def _resolve_format(cfg: DatasetConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.path == "arithmetic":
        return "arithmetic"
    if "gsm8k" in cfg.path.lower():
        return "gsm8k"
    if cfg.path.endswith(".jsonl"):
        return "jsonl"
    raise DatasetError(
        f"dataset path {cfg.path!r}: cannot tell its format; use 'arithmetic', a GSM8K path or "
        "id, or a .jsonl file, or set format= explicitly"
    )


def _raw_items(cfg: DatasetConfig, seed: int) -> list[dict[str, Any]]:
    fmt = _resolve_format(cfg)
    if fmt == "arithmetic":
        items = make_arithmetic(
            cfg.arithmetic, cfg.split, seed, cfg.instruction or ARITHMETIC_INSTRUCTION
        )
        if cfg.type == "sft":  # the worked solution (or bare answer) is the SFT target
            for item in items:
                item["messages"] = item["messages"] + [
                    {"role": "assistant", "content": item["solution"]}
                ]
        if cfg.type == "rw":  # preference pairs: the right answer over a near miss
            rng = random.Random(seed)
            for item in items:
                wrong = int(item["reference"]) + rng.choice((-2, -1, 1, 2))
                item.update(
                    prompt=item["messages"][-1]["content"],
                    chosen=item["solution"],
                    rejected=str(wrong),
                )
        return items
    if fmt == "gsm8k":
        items = load_gsm8k(cfg.path, cfg.split, cfg.instruction)
        if cfg.type == "sft":
            for item in items:
                item["messages"] = item["messages"] + [
                    {"role": "assistant", "content": item["reference"]}
                ]
        return items
    items = load_jsonl(cfg.path, cfg.type)
    if cfg.instruction and cfg.type == "rl":
        for item in items:
            last = item["messages"][-1]
            item["messages"] = item["messages"][:-1] + [
                {**last, "content": f"{last['content']}\n{cfg.instruction}"}
            ]
    return items


def tokenize_item(item: dict[str, Any], type: str, tokenizer: Any) -> dict[str, Any]:
    """Add token ids to an item: rl -> prompt_ids; sft -> input_ids + loss_mask; rw -> chosen_ids,
    rejected_ids and prompt_len."""
    if type == "rl":
        return {**item, "prompt_ids": prompt_ids(tokenizer, item["messages"])}
    if type == "sft":
        input_ids, loss_mask = sft_tokens(tokenizer, item["messages"])
        return {**item, "input_ids": input_ids, "loss_mask": loss_mask}
    user = [{"role": "user", "content": item["prompt"]}]
    pair = {
        f"{side}_ids": sft_tokens(tokenizer, user + [{"role": "assistant", "content": item[side]}])[
            0
        ]
        for side in ("chosen", "rejected")
    }
    return {**item, **pair, "prompt_len": len(prompt_ids(tokenizer, user))}


def _length(item: dict[str, Any]) -> int:
    for key in ("prompt_ids", "input_ids"):
        if key in item:
            return len(item[key])
    return max(len(item["chosen_ids"]), len(item["rejected_ids"]))


def load_dataset(cfg: DatasetConfig, tokenizer: Any = None, seed: int = 0) -> ItemDataset:
    """Items for ``cfg`` (first ``cfg.size``), tokenized when a tokenizer is given, with items
    longer than ``cfg.max_length`` tokens dropped (and the count logged)."""
    items = _raw_items(cfg, seed)
    if cfg.size is not None:
        items = items[: cfg.size]
    check_unique_ids(items, cfg.path)
    if tokenizer is not None:
        items = [tokenize_item(item, cfg.type, tokenizer) for item in items]
        if cfg.max_length is not None:
            kept = [item for item in items if _length(item) <= cfg.max_length]
            if len(kept) < len(items):
                logger.info(
                    "%s: dropped %d of %d items longer than max_length=%d tokens",
                    cfg.path, len(items) - len(kept), len(items), cfg.max_length,
                )  # fmt: skip
            items = kept
    if not items:
        raise DatasetError(f"{cfg.path} ({cfg.split}): no items left; check size and max_length")
    return ItemDataset(items, f"{cfg.path}:{cfg.split}")


class ShardedBatchSampler:
    """Per-rank batches of indices; reshuffled per epoch from the seed; resumable mid-epoch.
    ``pad=False``: an incomplete last batch is not padded (its share of each rank may be short or
    empty), so every item comes once per epoch."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool, drop_last: bool,
                 dp_rank: int, dp_world: int, pad: bool = True):  # fmt: skip
        if batch_size % dp_world:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by the {dp_world} data-parallel ranks; "
                f"use a multiple of {dp_world}"
            )
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_world})")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.shuffle, self.drop_last, self.pad = shuffle, drop_last, pad
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.epoch = 0
        self.offset = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``; an incomplete last batch (drop_last=False) is padded
        by wrapping around to the epoch's first indices so every rank gets the same count (unless
        ``pad`` is False)."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=gen).tolist()
        else:
            order = list(range(self.n))
        per_rank = self.batch_size // self.dp_world
        batches = []
        for b in range(len(self)):
            chunk = order[b * self.batch_size : (b + 1) * self.batch_size]
            if self.pad:
                short = self.batch_size - len(chunk)
                chunk += list(itertools.islice(itertools.cycle(order), short))
            batches.append(chunk[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank])
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches(self.epoch)
        while self.offset < len(batches):
            self.offset += 1
            yield batches[self.offset - 1]
        self.epoch += 1
        self.offset = 0

    def state_dict(self) -> dict[str, int]:
        """Where the sampler stands: epoch and batches already yielded in it."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`)."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def collate_items(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Batches stay lists of item dicts (workflows consume items one by one)."""
    return batch


def create_dataloader(dataset: ItemDataset, cfg: DatasetConfig, seed: int, dp_rank: int = 0,
                      dp_world: int = 1, pad: bool = True) -> StatefulDataLoader:  # fmt: skip
    """A resumable loader yielding this rank's ``cfg.batch_size // dp_world`` items per step
    (``pad=False``: fewer, maybe none, in an incomplete last batch; see
    :class:`ShardedBatchSampler`)."""
    if len(dataset) < cfg.batch_size and cfg.drop_last:
        raise DatasetError(
            f"{dataset.name}: {len(dataset)} items is fewer than batch_size={cfg.batch_size} "
            "with drop_last=true, so an epoch has no batch; lower batch_size or add data"
        )
    sampler = ShardedBatchSampler(
        len(dataset), cfg.batch_size, seed, cfg.shuffle, cfg.drop_last, dp_rank, dp_world, pad
    )
    # torchdata's constructor calls torch.set_vital, which torch deprecates with a UserWarning on
    # every start; the call is theirs and harmless (a telemetry flag), so that one warning is
    # silenced here, for this call only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_items, num_workers=0
        )
