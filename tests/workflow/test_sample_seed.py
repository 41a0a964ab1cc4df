"""Tier 1: gconfig.seed's per-sample seeds (reproducible rollouts whatever the batching)."""

from __future__ import annotations

import zlib

from areal.workflow.rlvr import sample_seed


def test_no_seed_keeps_the_servers_shared_generator():
    assert sample_seed(None, "arith-1", 0, 0) is None


def test_each_sample_prompt_and_version_gets_its_own_seed():
    assert sample_seed(7, "arith-1", 2, 3) == 7 + zlib.crc32(b"arith-1/2/3")
    seeds = {sample_seed(7, p, k, v) for p in ("a", "b") for k in range(4) for v in range(3)}
    assert len(seeds) == 24  # distinct samples never share a generator
    assert sample_seed(7, "a", 1, 0) == sample_seed(7, "a", 1, 0)  # the same sample: the same draws
    assert sample_seed(8, "a", 1, 0) == sample_seed(7, "a", 1, 0) + 1
