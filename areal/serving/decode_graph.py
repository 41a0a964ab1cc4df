"""The decode step with static shapes: batch padded to a bucket, compiled, and on CUDA replayed
as a CUDA graph per bucket (issue #59, item 1).

A step of decode rows only (no prompt joins) runs :func:`decode_forward`:
``B`` running rows are padded to the smallest bucket ``Bk >= B`` (1, 2, 4, ... ``max_batch``);
tokens, positions and the real/padding flag travel as one ``[3, Bk]`` int64 tensor, built on the
host and copied to the device in one transfer; attention reads the whole cache capacity under a
length mask (:class:`~.attention.MaskedAttention`), so no shape depends on a value and nothing is
read back to the host. Steps that admit prompts stay eager (:meth:`~.model.Qwen2Forward.step`'s
packed forward).

``compile``: the forward goes through ``torch.compile`` (inductor; ``dynamic=True``, so buckets
and cache capacities share one compiled graph, bucket 1 a second). ``graphs`` (CUDA only): per
bucket, the forward is captured once into a ``torch.cuda.CUDAGraph`` over a static input buffer
and replayed at each step; every bucket's graph shares one memory pool.

What keeps captured graphs valid: weight updates copy into the tensors the graphs read
(:meth:`~.model.Qwen2Forward.assign_weights`); the cache's tensors change only when it grows or
is released (``KVCache.generation``), and then every graph is dropped and recaptured at its
bucket's next step; :meth:`StaticDecode.reset` drops them at once (release_memory, so the pool's
memory goes back to the device).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from areal.api.config.loader import ConfigError
from areal.serving.attention import MaskedAttention
from areal.serving.cpu_attention import Mode
from areal.serving.model import KVCache, ModelSpec, Qwen2Forward, read_hf_config

logger = logging.getLogger(__name__)
Toggle = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class DecodeOptions:
    """How decode-only steps run: compiled or not, CUDA graphs or not, the batch buckets."""

    compile: bool
    graphs: bool
    buckets: tuple[int, ...]


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def decode_options(
    compile: Toggle,
    cuda_graphs: Toggle,
    buckets: list[int],
    device: torch.device,
    max_batch: int,
    spec: ModelSpec,
) -> DecodeOptions | None:
    """The static decode ``server.compile`` / ``server.cuda_graphs`` / ``server.decode_buckets``
    ask for on ``device``, None for the eager step; ``auto`` is on for CUDA, off on CPU. A family
    with sparse (MoE) layers routes tokens with data-dependent shapes, so it decodes eagerly
    (``on`` there is a :class:`ConfigError` naming the field, as ``cuda_graphs=on`` off CUDA
    is)."""
    cuda = device.type == "cuda"
    if cuda_graphs == "on" and not cuda:
        raise _refused(f"server.cuda_graphs=on needs a CUDA device, got {device}; use auto or off")
    use_compile = compile == "on" or (compile == "auto" and cuda)
    use_graphs = cuda_graphs == "on" or (cuda_graphs == "auto" and cuda)
    if not (use_compile or use_graphs):
        return None
    if spec.arch.experts is not None:
        for field, value in (("compile", compile), ("cuda_graphs", cuda_graphs)):
            if value == "on":
                raise _refused(
                    f"server.{field}=on: this model's sparse (MoE) layers route tokens with "
                    "data-dependent shapes, which a static decode step cannot hold; use auto or "
                    "off (it decodes eagerly)"
                )
        return None
    bad = [b for b in buckets if not 1 <= b <= max_batch]
    if bad:
        raise _refused(
            f"server.decode_buckets: {bad} outside 1..max_batch_size ({max_batch}); list sizes "
            "in that range, or [] for powers of two"
        )
    chosen = tuple(sorted({*buckets, max_batch})) if buckets else default_buckets(max_batch)
    return DecodeOptions(use_compile, use_graphs, chosen)


def _refused(problem: str) -> ConfigError:
    """The server-config error of one ``problem`` (``areal serve`` prints it in one message)."""
    return ConfigError([problem], "server")


def decode_forward(
    model: Qwen2Forward,
    attention: MaskedAttention,
    inputs: torch.Tensor,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
) -> torch.Tensor:
    """``model``'s decode step with fixed shapes and no host reads; logits ``[Bk, V]``.

    ``inputs [3, Bk]`` int64 holds each row's token, position, and 1 if the row is real or 0 if
    padding; row ``b`` is slot ``b``. Every row writes its key and value at its position, a
    padding row the values it found at position 0 of its (free) slot, so no cached key changes
    that a later request or a prefix may read.
    """
    tokens, positions, real = inputs[0], inputs[1], inputs[2]
    nkv, d = model.spec.n_kv_heads, model.spec.head_dim
    capacity = k_cache[0].shape[2]
    slots = torch.arange(tokens.shape[0], device=tokens.device)
    heads = torch.arange(nkv, device=tokens.device)
    rows = ((slots[:, None] * nkv + heads) * capacity + positions[:, None]).flatten()
    keep = (real != 0).repeat_interleave(nkv)[:, None]  # [Bk * kv_heads, 1]
    mask = attention.layout(positions + 1, capacity)  # [Bk, 1, 1, capacity]
    cos, sin = model.cos[positions][:, None], model.sin_signed[positions][:, None]
    h = F.embedding(tokens, model.embed)  # [Bk, H]
    for i, layer in enumerate(model.layers):
        q, k, v = model._qkv(h, layer, cos, sin)
        for store, new in ((k_cache[i], k), (v_cache[i], v)):
            flat = store.view(-1, d)  # [slots * kv_heads * capacity, head_dim]
            flat.index_put_((rows,), torch.where(keep, new.reshape(-1, d), flat[rows]))
        att = attention(q, k_cache[i], v_cache[i], mask)
        h = model.ops.linear_add(att, layer["o_w"], h, layer["o_b"])
        h = model._mlp_block(h, layer)
    return model.ops.linear(model._rms_norm(h, model.final_norm), model.lm_head)


def load_model(
    path: str | Path,
    device: str,
    dtype: torch.dtype,
    cpu_attention: Mode,
    static: tuple[Toggle, Toggle, list[int], int],
) -> tuple[Qwen2Forward, DecodeOptions | None]:
    """An HF model dir's forward and its :func:`decode_options` from ``static`` = ``(compile,
    cuda_graphs, decode_buckets, max_batch)``; the options are checked before the weights are
    read, and a compiled model gets plain weights (packed oneDNN ones are opaque to inductor)."""
    spec = ModelSpec(read_hf_config(path))
    compile, graphs, buckets, max_batch = static
    options = decode_options(compile, graphs, buckets, torch.device(device), max_batch, spec)
    pack = options is None or not options.compile
    return Qwen2Forward.from_pretrained(path, device, dtype, cpu_attention, pack), options


class _Captured:
    """One bucket's CUDA graph: its static input buffer and output logits."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, logits: torch.Tensor):
        self.graph, self.inputs, self.logits = graph, inputs, logits


class StaticDecode:
    """Runs decode-only steps of ``model`` per :class:`DecodeOptions` (module docstring)."""

    def __init__(self, model: Qwen2Forward, options: DecodeOptions):
        self.model, self.options = model, options
        attention = MaskedAttention()

        def fn(inputs, k_cache, v_cache):
            return decode_forward(model, attention, inputs, k_cache, v_cache)

        self.forward = torch.compile(fn, dynamic=True) if options.compile else fn
        self._graphs: dict[int, _Captured] = {}
        self._generation = -1  # the cache generation the graphs were captured over
        self._pool = None  # the graphs' shared memory pool
        self.captures = 0  # graphs captured so far (a test and the bench read it)

    def bucket(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows."""
        for b in self.options.buckets:
            if b >= batch:
                return b
        raise ValueError(f"{batch} decode rows exceed the largest bucket {self.options.buckets}")

    def reset(self) -> None:
        """Drop every captured graph and its memory pool (recaptured at the next step)."""
        self._graphs.clear()
        self._pool = None

    @torch.no_grad()
    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of ``B`` decode rows (slots ``0..B-1``) at ``positions`` (``tokens``
        and ``positions`` on the host); the cache holds every position already. Under graphs the
        result is a view of the graph's output: valid until the next step."""
        B = tokens.shape[0]
        Bk = self.bucket(B)
        inputs = torch.zeros(3, Bk, dtype=torch.long)  # token, position, real; on the host
        inputs[0, :B], inputs[1, :B], inputs[2, :B] = tokens, positions, 1
        if self.model.device.type == "cuda":  # one asynchronous copy to the device
            inputs = inputs.pin_memory()
        if not self.options.graphs:
            inputs = inputs.to(self.model.device, non_blocking=True)
            return self.forward(inputs, cache.k, cache.v)[:B]
        if cache.generation != self._generation:
            self.reset()
            self._generation = cache.generation
        captured = self._graphs.get(Bk) or self._capture(Bk, cache)
        captured.inputs.copy_(inputs, non_blocking=True)
        captured.graph.replay()
        return captured.logits[:B]

    def _capture(self, Bk: int, cache: KVCache) -> _Captured:
        """Warm up (compiling, if on) on a side stream, then capture bucket ``Bk``'s forward. All
        rows are padding while warming up and capturing: the cache is left as it was."""
        inputs = torch.zeros(3, Bk, dtype=torch.long, device=self.model.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(inputs, cache.k, cache.v)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(inputs, cache.k, cache.v)
        self.captures += 1
        logger.info(
            "decode: captured the CUDA graph of bucket %d over a cache of capacity %d (%d "
            "captures so far: each cache growth recaptures the buckets in use)",
            Bk,
            cache.capacity,
            self.captures,
        )
        self._graphs[Bk] = captured = _Captured(graph, inputs, logits)
        return captured
