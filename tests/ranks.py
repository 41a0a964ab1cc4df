"""Processes for the multi-rank tests (2-4 gloo ranks in one test), started from a fork server.

A spawned rank imports torch, transformers and the engine again: ~5 s of CPU each, ~26 ranks in
a run of the suite, on a 2-core machine where the suite is CPU-bound. Python's ``forkserver``
start method forks each rank from one server process per test worker that imported
:data:`PRELOAD` once. The server only imports: it never runs a torch op, so no OpenMP thread
pool or other thread state is copied into a rank (what makes a plain ``fork`` of a test worker
unsafe). A rank gets the test worker's ``sys.path`` and working directory, as with ``spawn``,
but the server's environment: a rank sets what it needs (``set_dist_env``), never reads what a
test set after the server started.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "areal.engine.fsdp",
]


def context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context; the first call sets what its server imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first rank
    return ctx


def run_ranks(fn: Callable[..., None], nprocs: int, args: tuple, timeout: float = 150.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; fail if any fails or time runs out."""
    context()
    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(f"{nprocs} processes did not finish within {timeout} s")
