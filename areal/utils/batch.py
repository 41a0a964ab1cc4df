"""Packed batches: variable-length sequences on one token axis, and how to split them.

A :class:`PackedBatch` holds ``cu_seqlens`` ([B+1], int64, cumulative sequence lengths), token
fields (each ``[T, ...]`` with ``T = cu_seqlens[-1]``; always ``input_ids``) and sequence fields
(each ``[B, ...]``). Token field ``x[t]`` belongs to token ``input_ids[t]``: e.g. ``logprobs[t]``
is log p(input_ids[t] | input_ids[:t]) within its sequence, so a sequence's first token has none
(0.0, and loss_mask 0).

Micro-batch splitting packs sequences (or groups of ``granularity`` consecutive sequences) into
bins under a token budget: first-fit-decreasing where bins are tried least-loaded first, which
keeps micro-batches balanced, with at least ``n_mbs`` bins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


class PackedBatch:
    """Sequences packed along one token axis, with per-token and per-sequence fields."""

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        tokens: dict[str, torch.Tensor],
        seqs: dict[str, torch.Tensor] | None = None,
    ):
        self.cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long)
        self.tokens = dict(tokens)
        self.seqs = dict(seqs or {})
        n_tok, n_seq = int(self.cu_seqlens[-1]), len(self.cu_seqlens) - 1
        if int(self.cu_seqlens[0]) != 0 or bool((self.cu_seqlens.diff() < 0).any()):
            raise ValueError(f"cu_seqlens must start at 0 and not decrease: {self.cu_seqlens}")
        if "input_ids" not in self.tokens:
            raise ValueError(
                f"a PackedBatch needs token field 'input_ids', got {list(self.tokens)}"
            )
        for k, v in self.tokens.items():
            if v.shape[0] != n_tok:
                raise ValueError(f"token field {k!r} has {v.shape[0]} rows, expected {n_tok}")
        for k, v in self.seqs.items():
            if v.shape[0] != n_seq:
                raise ValueError(f"sequence field {k!r} has {v.shape[0]} rows, expected {n_seq}")
        overlap = set(self.tokens) & set(self.seqs)
        if overlap:
            raise ValueError(f"fields {sorted(overlap)} are both token and sequence fields")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_sequences(
        cls,
        token_fields: Mapping[str, Sequence[Sequence]],
        seq_fields: Mapping[str, Sequence | torch.Tensor] | None = None,
    ) -> PackedBatch:
        """Pack lists of per-sequence lists, e.g. ``{"input_ids": [[1, 2], [3]]}``; a sequence
        field is one value per sequence (a list or a tensor)."""
        lens = [len(s) for s in token_fields["input_ids"]]
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(lens, dtype=torch.long).cumsum(0)
        tokens = {}
        for k, rows in token_fields.items():
            if [len(r) for r in rows] != lens:
                raise ValueError(f"token field {k!r} lengths differ from input_ids lengths {lens}")
            flat = [x for r in rows for x in r]
            dtype = torch.long if k == "input_ids" or (flat and isinstance(flat[0], int)) else None
            tokens[k] = torch.tensor(flat, dtype=dtype if dtype else torch.float32)
        seqs = {k: torch.as_tensor(v) for k, v in (seq_fields or {}).items()}
        return cls(cu, tokens, seqs)

    # -- access -------------------------------------------------------------------------------

    @property
    def n_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seqlens(self) -> torch.Tensor:
        """[B] tokens per sequence."""
        return self.cu_seqlens.diff()

    def keys(self) -> tuple[set[str], set[str]]:
        return set(self.tokens), set(self.seqs)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.tokens:
            return self.tokens[key]
        if key in self.seqs:
            return self.seqs[key]
        raise KeyError(
            f"{key!r} is not a field; token fields {sorted(self.tokens)}, "
            f"sequence fields {sorted(self.seqs)}"
        )

    def __contains__(self, key: str) -> bool:
        return key in self.tokens or key in self.seqs

    def with_fields(
        self,
        tokens: dict[str, torch.Tensor] | None = None,
        seqs: dict[str, torch.Tensor] | None = None,
    ) -> PackedBatch:
        """A new batch with extra/replaced fields (the original is unchanged)."""
        return PackedBatch(
            self.cu_seqlens, {**self.tokens, **(tokens or {})}, {**self.seqs, **(seqs or {})}
        )

    def position_ids(self) -> torch.Tensor:
        """[T] position of each token within its own sequence."""
        starts = torch.repeat_interleave(self.cu_seqlens[:-1], self.seqlens)
        return torch.arange(self.n_tokens, device=self.cu_seqlens.device) - starts

    def seq_index(self) -> torch.Tensor:
        """[T] index of the sequence each token belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.n_seqs, device=self.cu_seqlens.device), self.seqlens
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.cu_seqlens.to(device),
            {k: v.to(device) for k, v in self.tokens.items()},
            {k: v.to(device) for k, v in self.seqs.items()},
        )

    def select(self, indices: Sequence[int]) -> PackedBatch:
        """The sequences at ``indices``, in that order."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        cpu_cu = self.cu_seqlens.cpu()
        token_idx = (
            torch.cat([torch.arange(int(cpu_cu[i]), int(cpu_cu[i + 1])) for i in idx.tolist()])
            if len(idx)
            else torch.zeros(0, dtype=torch.long)
        )
        token_idx = token_idx.to(self.cu_seqlens.device)
        lens = self.seqlens[idx.to(self.cu_seqlens.device)]
        cu = torch.zeros(len(idx) + 1, dtype=torch.long, device=self.cu_seqlens.device)
        cu[1:] = lens.cumsum(0)
        return PackedBatch(
            cu,
            {k: v[token_idx] for k, v in self.tokens.items()},
            {k: v[idx.to(v.device)] for k, v in self.seqs.items()},
        )

    # -- padding ------------------------------------------------------------------------------

    def to_padded(self, pad_value: float = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Token fields as [B, Lmax] (right-padded with ``pad_value``) and the [B, Lmax] mask."""
        lmax = int(self.seqlens.max()) if self.n_seqs else 0
        pos = self.position_ids()
        rows = self.seq_index()
        mask = torch.zeros(self.n_seqs, lmax, dtype=torch.bool, device=self.cu_seqlens.device)
        mask[rows, pos] = True
        out = {}
        for k, v in self.tokens.items():
            padded = torch.full(
                (self.n_seqs, lmax, *v.shape[1:]), pad_value, dtype=v.dtype, device=v.device
            )
            padded[rows, pos] = v
            out[k] = padded
        return out, mask

    @classmethod
    def from_padded(
        cls,
        padded: dict[str, torch.Tensor],
        attention_mask: torch.Tensor,
        seqs: dict[str, torch.Tensor] | None = None,
    ) -> PackedBatch:
        """Inverse of :meth:`to_padded` (right padding: each row's valid tokens come first)."""
        lens = attention_mask.sum(1).long()
        cu = torch.zeros(len(lens) + 1, dtype=torch.long, device=attention_mask.device)
        cu[1:] = lens.cumsum(0)
        mask = attention_mask.bool()
        return cls(cu, {k: v[mask] for k, v in padded.items()}, seqs)


# ---------------------------------------------------------------------------------- splitting


def allocate_bins(
    lengths: Sequence[int], n_min_bins: int = 1, capacity: int | None = None
) -> list[list[int]]:
    """Assign items to bins: first-fit-decreasing, trying bins least-loaded first.

    Opens ``max(n_min_bins, ceil(sum / capacity))`` bins (never more than there are items), then
    places items longest first into the least-loaded bin with room, opening a new bin when none
    fits. Returns each bin's item indices ascending; bins ordered by their first index.
    """
    if capacity is not None:
        for i, n in enumerate(lengths):
            if n > capacity:
                raise ValueError(
                    f"item {i} has {n} tokens, more than the micro-batch budget "
                    f"max_tokens_per_mb={capacity}; raise the budget to at least {n}"
                )
    if not lengths:
        return []
    need = math.ceil(sum(lengths) / capacity) if capacity else 1
    n_bins = min(len(lengths), max(n_min_bins, need))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        order = sorted(range(len(bins)), key=lambda b: (loads[b], b))
        target = next(
            (b for b in order if capacity is None or loads[b] + lengths[i] <= capacity), None
        )
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        loads[target] += lengths[i]
    bins = [sorted(b) for b in bins if b]
    return sorted(bins, key=lambda b: b[0])


def _units(n_seqs: int, granularity: int) -> list[list[int]]:
    if n_seqs % granularity:
        raise ValueError(
            f"{n_seqs} sequences cannot be kept in groups of granularity={granularity}; "
            "make the batch a multiple of the group size"
        )
    return [list(range(s, s + granularity)) for s in range(0, n_seqs, granularity)]


@dataclass
class MicroBatches:
    """Micro-batches plus the sequence indices each holds, to restore the original order."""

    mbs: list[PackedBatch]
    indices: list[list[int]]

    def restore_order(self, per_seq_outputs: Iterable[Sequence]) -> list:
        """Given each micro-batch's per-sequence outputs, return them in original order."""
        out: dict[int, object] = {}
        for idx, outputs in zip(self.indices, per_seq_outputs):
            out.update(zip(idx, outputs))
        return [out[i] for i in range(len(out))]


def split_microbatches(
    batch: PackedBatch, n_mbs: int = 1, max_tokens_per_mb: int | None = None, granularity: int = 1
) -> MicroBatches:
    """Split into at least ``n_mbs`` micro-batches of at most ``max_tokens_per_mb`` tokens.

    Runs of ``granularity`` consecutive sequences (a group) stay in one micro-batch.
    """
    units = _units(batch.n_seqs, granularity)
    seqlens = batch.seqlens.tolist()
    unit_lens = [sum(seqlens[i] for i in u) for u in units]
    try:
        bins = allocate_bins(unit_lens, n_mbs, max_tokens_per_mb)
    except ValueError as e:
        raise ValueError(f"cannot split batch (granularity={granularity}): {e}") from None
    indices = [[i for u in b for i in units[u]] for b in bins]
    return MicroBatches([batch.select(idx) for idx in indices], indices)


def balance_across_ranks(batch: PackedBatch, n_ranks: int, granularity: int = 1) -> list[list[int]]:
    """Sequence indices for each data-parallel rank with near-equal token counts.

    Every rank gets the same number of groups when the count divides evenly (so every rank runs
    the same number of steps); groups are assigned longest-first to the least-loaded rank.
    """
    units = _units(batch.n_seqs, granularity)
    if len(units) < n_ranks:
        raise ValueError(
            f"{len(units)} groups cannot feed {n_ranks} data-parallel ranks; "
            "raise the batch size to at least one group per rank"
        )
    seqlens = batch.seqlens.tolist()
    unit_lens = [sum(seqlens[i] for i in u) for u in units]
    per_rank = len(units) // n_ranks
    extra = len(units) % n_ranks
    quota = [per_rank + (1 if r < extra else 0) for r in range(n_ranks)]
    loads, parts = [0] * n_ranks, [[] for _ in range(n_ranks)]
    for u in sorted(range(len(units)), key=lambda j: (-unit_lens[j], j)):
        r = min(
            (r for r in range(n_ranks) if len(parts[r]) < quota[r]), key=lambda r: (loads[r], r)
        )
        parts[r].append(u)
        loads[r] += unit_lens[u]
    return [[i for u in sorted(p) for i in units[u]] for p in parts]


def split_by_tokens(seqlens: list[int], n_ranks: int, group_size: int) -> list[list[int]]:
    """Positions of ``seqlens`` for each rank, near-equal tokens, groups of ``group_size`` kept
    whole (:func:`balance_across_ranks` on lengths alone: Core's master places samples by it)."""
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(seqlens, dtype=torch.long).cumsum(0)
    # Lengths only: a stride-0 view stands in for input_ids, so no token memory is allocated.
    lengths_only = PackedBatch(
        cu, {"input_ids": torch.zeros(1, dtype=torch.long).expand(int(cu[-1]))}
    )
    return balance_across_ranks(lengths_only, n_ranks, granularity=group_size)
