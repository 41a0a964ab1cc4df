"""Decode attention over the slot cache: one interface, an implementation per device.

A decode step's rows ``0..B-1`` each hold one query token; row ``b`` attends over the first
``lengths[b]`` cached keys and values of slot ``b`` (cache layer tensors ``[slots, kv_heads,
capacity, head_dim]``, :class:`~.model.KVCache`). Queries come pre-scaled by 1/sqrt(head_dim)
(the model folds the scale into its q weights). Every implementation takes ``q [B, heads,
head_dim]`` and returns ``[B, heads * head_dim]``; :meth:`SlotAttention.layout` turns the step's
``lengths [B]`` into what its layers read (built once per step, shared by every layer).

Implementations (:func:`choose_attention`):

- :class:`KernelAttention`: the C kernel of :mod:`.cpu_attention` (CPU fp32), reading each row's
  keys exactly up to its own length. Not traceable (a ctypes call): eager steps only.
- :class:`RunsAttention`: two batched matmuls per run of ``run`` slots, each run reading keys up
  to its own longest row (the generator keeps longer rows in earlier runs: :mod:`.slots`). Reads
  the lengths on the host: CPU eager steps only (where that is no device sync).
- :class:`MaskedAttention`: ``scaled_dot_product_attention`` over the whole capacity with a
  length mask. Static shapes and no host reads, so it runs inside ``torch.compile`` and CUDA
  graphs (:mod:`.decode_graph`); the choice on CUDA, and on CPU for the static decode step.

Query heads that share a KV head are laid out as extra query rows of that head (HF's
``repeat_kv`` gives query head ``j`` KV head ``j // group``), so grouped attention never copies
the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from areal.serving.cpu_attention import DecodeAttentionKernel, Mode, load_decode_attention

ATTENTION_RUN = 16  # slots per run of RunsAttention


class SlotAttention(ABC):
    """Rows ``0..B-1`` (one query each, slot == row) attend over their cached keys."""

    name: str  # reported by /get_server_info as decode_attention
    static: bool = False  # no host reads, fixed shapes: can be compiled and graph-captured
    run: int | None = None  # slots per attention run (slots.vacate keeps longer rows first)

    def layout(self, lengths: torch.Tensor, capacity: int) -> Any:
        """What every layer of one step reads, from each row's key count ``lengths [B]`` (int64,
        ``1..capacity``) and the cache's ``capacity``."""
        return lengths

    @abstractmethod
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any
    ) -> torch.Tensor:
        """``q [B, heads, head_dim]`` (pre-scaled) over cache layer ``k, v`` -> ``[B, heads *
        head_dim]``."""


class KernelAttention(SlotAttention):
    """The compiled C kernel (:mod:`.cpu_attention`); the layout is ``lengths`` itself."""

    name = "compiled"

    def __init__(self, kernel: DecodeAttentionKernel):
        self.kernel = kernel

    def __call__(self, q, k, v, layout):
        return self.kernel(q.flatten(1), k, v, layout)


class RunsAttention(SlotAttention):
    """Batched matmuls per run of ``run`` slots; the layout is :func:`runs_layout`'s runs."""

    name = "torch"

    def __init__(self, kv_heads: int, group: int, dtype: torch.dtype, run: int = ATTENTION_RUN):
        self.kv_heads, self.group, self.dtype, self.run = kv_heads, group, dtype, run

    def layout(self, lengths: torch.Tensor, capacity: int) -> list[tuple[int, int, torch.Tensor]]:
        run = self.run or ATTENTION_RUN  # set from __init__; the base class allows None
        return runs_layout(lengths.tolist(), run, self.kv_heads, self.group, self.dtype)

    def __call__(self, q, k, v, layout):
        """``[rows, kv_heads]`` of the cache merge into one batch dimension of a strided view (no
        copy). Two batched matmuls (the first adding the bias) beat SDPA's masked CPU kernel."""
        B, heads, d = q.shape
        nkv, capacity = k.shape[1], k.shape[2]
        q = q.reshape(B * nkv, heads // nkv, d)
        out = torch.empty_like(q)
        step = capacity * d  # elements between consecutive (slot, kv_head) blocks
        for a, b, bias in layout:
            n, L, rows, at = (b - a) * nkv, bias.shape[-1], slice(a * nkv, b * nkv), a * nkv * step
            k_t = k.as_strided((n, d, L), (step, 1, d), k.storage_offset() + at)  # transposed
            v_run = v.as_strided((n, L, d), (step, d, 1), v.storage_offset() + at)
            scores = torch.baddbmm(bias, q[rows], k_t)  # q pre-scaled
            torch.bmm(scores.softmax(-1), v_run, out=out[rows])
        return out.view(B, -1)  # [B, heads * d]


def runs_layout(
    lengths: list[int], n: int, kv_heads: int, group: int, dtype: torch.dtype
) -> list[tuple[int, int, torch.Tensor]]:
    """Rows split into runs of ``n`` slots, each with its own key length.

    Returns ``(first_row, end_row, bias)`` per run; ``bias [rows * kv_heads, group, L_run]`` is 0
    below each row's length and -inf from it, with ``L_run`` the run's longest row (views into one
    bias built for the whole batch).
    """
    if not lengths:
        return []
    B, L = len(lengths), max(lengths)
    own = torch.tensor(lengths)
    future = torch.arange(L)[None, :] >= own[:, None]  # [B, L]
    bias = (
        torch.zeros(B, 1, 1, L, dtype=dtype)
        .masked_fill_(future[:, None, None], float("-inf"))
        .expand(B, kv_heads, group, L)
        .reshape(B * kv_heads, group, L)
    )
    return [
        (
            a,
            min(a + n, B),
            bias[a * kv_heads : min(a + n, B) * kv_heads, :, : max(lengths[a : a + n])],
        )
        for a in range(0, B, n)
    ]


class MaskedAttention(SlotAttention):
    """SDPA over the whole cache capacity with a length mask; the layout is the mask ``[B, 1, 1,
    capacity]`` (True = attend), built on the device: no host read, shapes fixed by the batch
    and the capacity."""

    name = "masked"
    static = True

    def layout(self, lengths: torch.Tensor, capacity: int) -> torch.Tensor:
        keys = torch.arange(capacity, device=lengths.device)
        return (keys[None, :] < lengths[:, None])[:, None, None, :]

    def __call__(self, q, k, v, layout):
        B, heads, d = q.shape
        nkv = k.shape[1]
        qg = q.view(B, nkv, heads // nkv, d)  # a KV head's query heads as its query rows
        out = F.scaled_dot_product_attention(qg, k[:B], v[:B], attn_mask=layout, scale=1.0)
        return out.reshape(B, heads * d)


def choose_attention(
    mode: Mode, device: torch.device, dtype: torch.dtype, kv_heads: int, group: int
) -> SlotAttention:
    """The eager decode attention for a model on ``device``: on CPU the C kernel per ``mode``
    (:func:`~.cpu_attention.load_decode_attention`) else the matmul runs; elsewhere (CUDA) the
    masked SDPA."""
    if device.type != "cpu":
        load_decode_attention(mode, device, dtype)  # validates mode
        return MaskedAttention()
    kernel = load_decode_attention(mode, device, dtype)
    return KernelAttention(kernel) if kernel else RunsAttention(kv_heads, group, dtype)
