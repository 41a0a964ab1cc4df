"""The running batch's slot layout: request ``i`` of the running list lives in KV-cache slot
``i``, and slots ``0..B-1`` stay filled as requests leave (:func:`vacate`).

On the matmul attention path (``Qwen2Forward.attention_run`` set) decode rows are read in runs of
``attention_run`` slots, each run only up to its own longest row's keys; keeping longer requests in
earlier runs keeps the short runs cheap. The compiled attention kernel reads exact lengths and
has no runs (``attention_run`` None).

New requests take the slots after the running ones; :func:`group_prompts` says which of those
admitted together share one prompt's prefill.
"""

from __future__ import annotations

from areal.serving.model import KVCache
from areal.serving.requests import Seq


def _move(running: list[Seq], cache: KVCache, src: int, dst: int) -> int:
    """Move the request in slot ``src`` (and its cache rows) to slot ``dst``; returns ``src``."""
    moved = running[src]
    cache.move_slot(src, dst, len(moved.prompt) + len(moved.out) - 1)
    running[dst] = moved
    return src


def vacate(running: list[Seq], slot: int, cache: KVCache, run: int | None) -> Seq:
    """Take the request in ``slot`` out of ``running`` (index == cache slot) and refill the slot
    so the running requests stay in slots ``0..len-1``; returns the request taken out.

    The hole in one attention run is filled by the longest request of the next run, whose hole
    is filled the same way, down to the last run, whose hole takes the last slot. Runs thus keep
    longer requests first, and each reads keys only up to its own longest row. Without runs
    (``run`` None) the last slot fills the hole.
    """
    seq, hole, last = running[slot], slot, len(running) - 1
    while run and (start := (hole // run + 1) * run) < last:
        nxt = range(start, min(start + run, last + 1))
        longest = max(nxt, key=lambda j: len(running[j].prompt) + len(running[j].out))
        hole = _move(running, cache, longest, hole)
    if hole != last:
        _move(running, cache, last, hole)
    running.pop()
    return seq


def group_prompts(admitted: list[Seq], share: bool) -> tuple[list[Seq], list[Seq], list[int]]:
    """``(leaders, followers, follows)``: the admitted requests with distinct prompts (one
    prefill each), the others, and for each of those the index of the leader whose prompt it
    shares (its cache rows are copied from the leader's slot). Without ``share`` every request
    leads."""
    first: dict[tuple[int, ...], int] = {}  # prompt -> index among the distinct prompts
    leaders: list[Seq] = []
    followers: list[Seq] = []
    follows: list[int] = []
    for seq in admitted:
        key = tuple(seq.prompt) if share else (id(seq),)
        if key in first:
            followers.append(seq)
            follows.append(first[key])
        else:
            first[key] = len(leaders)
            leaders.append(seq)
    return leaders, followers, follows
