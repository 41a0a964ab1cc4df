"""Shared-prefix layout: a micro-batch whose groups share a prompt, with each prompt laid out once.

The ``n`` samples of a GRPO group are ``prompt + completion_i``: in the plain packed layout the
prompt is run ``n`` times in every forward and backward. :func:`share_prefixes` lays a group out
as one row segment ``[prompt, completion_1, ..., completion_n]``: the prompt's positions are
``0..P-1`` and every completion's restart at ``P``; attention lets a prompt token see the prompt
tokens before it and a completion token see the whole prompt plus its own completion up to
itself (:attr:`SharedPrefixRow.masks`). Every token then has exactly the keys, values and
positions it has in its own sequence, so its logits are the plain layout's (up to float
rounding). :attr:`SharedPrefixRow.index` maps each token of the plain layout to its row
position; ``logits_row[index]`` is the plain layout's ``[T, V]``, and its backward adds the
gradients of a shared prompt position over the group's samples.

Sequences are grouped when they are consecutive, have the same ``group_index`` and
``prompt_lens`` and the same prompt tokens (checked); anything else is a group of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal.utils.batch import PackedBatch


@dataclass(frozen=True)
class SharedPrefixRow:
    """One micro-batch in the shared-prefix layout (see the module docstring)."""

    input_ids: torch.Tensor  # [S] row tokens, S <= T
    position_ids: torch.Tensor  # [S]
    index: torch.Tensor  # [T] plain-layout token -> row position
    bounds: list[tuple[int, int]]  # [(start, end)] row segment of each group
    masks: list[torch.Tensor | None]  # [n, n] bool (True = attend) per group; None = plain causal


def _groups(mb: PackedBatch) -> list[list[int]]:
    """Runs of consecutive sequences that share a prompt (length 1 where none is shared)."""
    ids, cu = mb["input_ids"], mb.cu_seqlens.tolist()
    gidx, plen = mb["group_index"].tolist(), mb["prompt_lens"].tolist()
    runs: list[list[int]] = []
    for s in range(mb.n_seqs):
        if runs:
            first = runs[-1][0]
            p = plen[s]
            if (
                gidx[s] == gidx[first]
                and p == plen[first]
                and 0 < p <= cu[s + 1] - cu[s]
                and torch.equal(ids[cu[s] : cu[s] + p], ids[cu[first] : cu[first] + p])
            ):
                runs[-1].append(s)
                continue
        runs.append([s])
    return runs


def _group_mask(prompt: int, lens: list[int]) -> torch.Tensor:
    """[n, n] attention of one group segment: causal prompt; each completion sees the prompt
    and itself causally."""
    n = prompt + sum(lens)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    start = prompt
    for length in lens:
        mask[start : start + length, :prompt] = True
        mask[start : start + length, start : start + length] = torch.ones(
            length, length, dtype=torch.bool
        ).tril()
        start += length
    return mask


def share_prefixes(mb: PackedBatch) -> SharedPrefixRow | None:
    """``mb`` in the shared-prefix layout, or None when no prompt is shared (or the batch has no
    ``group_index``/``prompt_lens`` fields, e.g. SFT data)."""
    if "group_index" not in mb.seqs or "prompt_lens" not in mb.seqs:
        return None
    runs = _groups(mb)
    if all(len(r) == 1 for r in runs):
        return None
    ids, cu = mb["input_ids"], mb.cu_seqlens.tolist()
    row_ids, row_pos, index = [], [], torch.empty(mb.n_tokens, dtype=torch.long)
    bounds, masks = [], []
    start = 0
    for run in runs:
        prompt = int(mb["prompt_lens"][run[0]]) if len(run) > 1 else cu[run[0] + 1] - cu[run[0]]
        s0 = cu[run[0]]
        row_ids.append(ids[s0 : s0 + prompt])
        row_pos.append(torch.arange(prompt))
        offset = start + prompt
        lens = []
        for s in run:
            a, b = cu[s], cu[s + 1]
            index[a : a + prompt] = torch.arange(start, start + prompt)
            length = b - a - prompt
            index[a + prompt : b] = torch.arange(offset, offset + length)
            row_ids.append(ids[a + prompt : b])
            row_pos.append(torch.arange(prompt, prompt + length))
            lens.append(length)
            offset += length
        bounds.append((start, offset))
        masks.append(_group_mask(prompt, lens) if len(run) > 1 else None)
        start = offset
    return SharedPrefixRow(torch.cat(row_ids), torch.cat(row_pos), index, bounds, masks)
