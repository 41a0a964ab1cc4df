"""Scoped stats tracking that reduces across data-parallel ranks.

Record inside named scopes (``with tracker.scope("loss"):``) so metric names come out namespaced
(``loss/clip_frac``); the top-level namespaces in use are ``rollout/``, ``reward/``, ``loss/``,
``perf/``, ``timing/`` and ``staleness/``. Each metric has one reduction:

- ``mean``: masked mean over tokens or sequences: accumulates sum(x * mask) and sum(mask), so the
  exported value is the mean over *every* element recorded on *every* rank (not a mean of means);
- ``sum``; ``min``; ``max``;
- timers (``with tracker.timer("rollout")``) add seconds under ``timing/<scope>/<name>``.

``export(group)`` all-reduces (sum / min / max) across the process group and resets.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from areal.utils.comm import all_reduce_host, group_device

_REDUCTIONS = ("mean", "sum", "min", "max")


class StatsTracker:
    """Accumulates metrics between exports; see the module docstring for the semantics."""

    def __init__(self) -> None:
        self._scope: list[str] = []
        self._num: dict[str, float] = defaultdict(float)  # mean numerators and sums
        self._den: dict[str, float] = defaultdict(float)  # mean denominators
        self._kind: dict[str, str] = {}
        self._ext: dict[str, float] = {}  # running min / max

    # -- recording ----------------------------------------------------------------------------

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix names recorded inside with ``name/``."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def _key(self, name: str, kind: str) -> str:
        key = "/".join([*self._scope, name])
        prev = self._kind.setdefault(key, kind)
        if prev != kind:
            raise ValueError(f"metric {key!r} was recorded as {prev!r}, now as {kind!r}")
        return key

    def mean(
        self, name: str, values: torch.Tensor | float, mask: torch.Tensor | None = None
    ) -> None:
        """Add elements to a masked mean (``mask`` selects tokens/sequences; None = all)."""
        v = torch.as_tensor(values, dtype=torch.float64).detach().cpu().flatten()
        m = (
            torch.ones_like(v)
            if mask is None
            else torch.as_tensor(mask).detach().cpu().flatten().double()
        )
        if m.shape != v.shape:
            raise ValueError(
                f"stat {name!r}: values {tuple(v.shape)} and mask {tuple(m.shape)} differ"
            )
        key = self._key(name, "mean")
        self._num[key] += float((v * m).sum())
        self._den[key] += float(m.sum())

    def scalars(self, **values: float) -> None:
        """Record scalars, each one element of a mean (e.g. grad_norm per step)."""
        for name, value in values.items():
            self.mean(name, float(value))

    def sum(self, name: str, value: torch.Tensor | float) -> None:
        """Add to a sum (e.g. token counts)."""
        self._num[self._key(name, "sum")] += float(
            torch.as_tensor(value, dtype=torch.float64).sum()
        )

    def _extreme(self, name: str, values, mask, kind: str) -> None:
        v = torch.as_tensor(values, dtype=torch.float64).detach().cpu().flatten()
        if mask is not None:
            v = v[torch.as_tensor(mask).detach().cpu().flatten().bool()]
        key = self._key(name, kind)
        if v.numel():
            x = float(v.min() if kind == "min" else v.max())
            old = self._ext.get(key)
            self._ext[key] = x if old is None else (min(old, x) if kind == "min" else max(old, x))

    def min(self, name: str, values, mask: torch.Tensor | None = None) -> None:
        """Track the minimum over (masked) elements."""
        self._extreme(name, values, mask, "min")

    def max(self, name: str, values, mask: torch.Tensor | None = None) -> None:
        """Track the maximum over (masked) elements."""
        self._extreme(name, values, mask, "max")

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the block's wall time (seconds) to ``timing/<scope>/<name>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = "/".join(["timing", *self._scope, name])
            self._kind.setdefault(key, "sum")
            self._num[key] += time.perf_counter() - start

    # -- export -------------------------------------------------------------------------------

    def export(
        self, group: dist.ProcessGroup | None = None, reset: bool = True
    ) -> dict[str, float]:
        """Reduce over ``group`` (when torch.distributed is initialised) and return name -> value.

        Means with an empty denominator on every rank are left out rather than reported as 0.
        """
        kinds = dict(self._kind)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:  # ranks may have recorded different names: use the union
            group_device(
                group
            )  # a group this process cannot stage on is refused before any collective
            gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(gathered, kinds, group=group)
            for g in gathered:
                kinds.update(g)
        keys = sorted(kinds)
        sums = torch.tensor(
            [[self._num.get(k, 0.0), self._den.get(k, 0.0)] for k in keys], dtype=torch.float64
        ).reshape(-1, 2)
        inf = float("inf")
        mins = torch.tensor(
            [self._ext.get(k, inf) if kinds[k] == "min" else inf for k in keys], dtype=torch.float64
        )
        maxs = torch.tensor(
            [self._ext.get(k, -inf) if kinds[k] == "max" else -inf for k in keys],
            dtype=torch.float64,
        )
        if distributed:  # host values: staged on a device the group serves (NCCL-only on a GPU)
            sums = all_reduce_host(sums, dist.ReduceOp.SUM, group)
            mins = all_reduce_host(mins, dist.ReduceOp.MIN, group)
            maxs = all_reduce_host(maxs, dist.ReduceOp.MAX, group)
        out: dict[str, float] = {}
        for i, k in enumerate(keys):
            kind = kinds[k]
            if kind == "mean" and sums[i, 1] > 0:
                out[k] = float(sums[i, 0] / sums[i, 1])
            elif kind == "sum":
                out[k] = float(sums[i, 0])
            elif kind == "min" and mins[i] != inf:
                out[k] = float(mins[i])
            elif kind == "max" and maxs[i] != -inf:
                out[k] = float(maxs[i])
        if reset:
            self.__init__()
        return out
