"""Datasets: GSM8K, synthetic arithmetic, generic JSONL (RL / SFT / RM), and a resumable
DP-sharded dataloader.

Item schema (plain dicts; a batch from the dataloader is a list of them). ``id`` is stable across
runs and unique in a dataset: recover state and failure logs name samples by it.

* **rl** (consumed by ``areal.workflow``)::

      {"id": str,
       "messages": [{"role": "user", "content": str}, ...],   # the prompt as chat messages
       "prompt_ids": list[int],      # chat template + assistant header; present when loaded
                                     # with a tokenizer (workflows build it from messages if not)
       "reference": Any,             # passed to the reward function: a math answer / GSM8K
                                     # solution (str), or code test cases (list of dicts)
       ...}                          # extra JSONL fields are kept (e.g. "solution" for arithmetic)

* **sft**: ``{"id", "messages" (ending with the assistant target), "input_ids", "loss_mask"}``
  (loss on assistant turns only; the last two when loaded with a tokenizer).
* **rw**: ``{"id", "prompt", "chosen", "rejected", "chosen_ids", "rejected_ids", "prompt_len"}``
  (the last three when loaded with a tokenizer).

Entry points: :func:`load_dataset` ``(cfg: DatasetConfig, tokenizer=None, seed=0)`` and
:func:`create_dataloader` ``(dataset, cfg, seed, dp_rank=0, dp_world=1) -> StatefulDataLoader``.
"""

from areal.dataset.arithmetic import make_arithmetic
from areal.dataset.gsm8k import load_gsm8k
from areal.dataset.jsonl import DatasetError, load_jsonl
from areal.dataset.loader import (
    ItemDataset,
    ShardedBatchSampler,
    create_dataloader,
    load_dataset,
    tokenize_item,
)

__all__ = [
    "DatasetError",
    "ItemDataset",
    "ShardedBatchSampler",
    "create_dataloader",
    "load_dataset",
    "load_gsm8k",
    "load_jsonl",
    "make_arithmetic",
    "tokenize_item",
]
