"""A prefix cache across requests: the keys and values of token blocks computed for earlier
requests, kept in a bounded pool and copied into a new request's cache slot, so its prefill
starts after them (the turns of an agent's conversation, the samples of a GRPO group sent as
separate requests, prompts sharing a system prompt).

Keys: a sequence is cut into blocks of ``block`` tokens. Block ``i``'s entry is keyed by (the
pool block of block ``i - 1``'s entry, or -1, and its tokens), so an entry stands for the whole
prefix up to its block: a radix tree of blocks held in one dict. A lookup walks a prompt's
blocks until one is missing: the longest cached prefix in whole blocks, leaving at least one
token to prefill (its logits start the request's sampling). Partial blocks are never cached.

Pool: per layer ``k``, ``v`` of shape ``[n_blocks, kv_heads, block, head_dim]``, grown by
doubling up to ``max_tokens // block`` blocks, so memory follows use and never passes the bound
(``server.prefix_cache_tokens``). When the pool is full the least recently used entry that no
other entry extends (a leaf) is evicted. A use touches its path from the leaf up to the root, so
an entry is always more recent than the entries under it: the oldest entry is a leaf and
eviction is one pop (entries of the insertion under way are skipped).

Validity: keys and values depend on the weights. :meth:`clear` (every weight update) and
:meth:`release` (memory given back) drop every entry and bump ``epoch``; the generator stores a
request's blocks only when they were computed in the current epoch. Only the scheduler thread
calls this class; the counters are read from any thread.
"""

from __future__ import annotations

import collections

import torch

from areal.serving.model import KVCache, ModelSpec
from areal.serving.requests import Seq

Key = tuple[int, tuple[int, ...]]  # (parent block or -1, the block's tokens)
FIRST_BLOCKS = 16  # blocks of the first allocation (then doubling)


class PrefixCache:
    """Cached keys/values of token blocks across requests; see the module docstring. With
    ``max_tokens`` 0 it is off: it caches nothing, finds nothing and reports no counters."""

    def __init__(self, spec: ModelSpec, max_tokens: int, block: int, device, dtype):
        if block < 1 or 0 < max_tokens < block:
            raise ValueError(
                f"prefix cache: max_tokens={max_tokens} holds no block of {block} tokens; "
                "raise server.prefix_cache_tokens to at least server.prefix_cache_block"
            )
        self.spec, self.block = spec, block
        self.max_blocks = max_tokens // block
        self.device, self.dtype = torch.device(device), dtype
        self.k: list[torch.Tensor] = []  # per layer [n_blocks, kv_heads, block, head_dim]
        self.v: list[torch.Tensor] = []
        self.n_blocks = 0  # allocated
        self._entries: dict[Key, int] = {}  # key -> pool block
        self._key: dict[int, Key] = {}  # pool block -> its key
        self._children: collections.Counter[int] = collections.Counter()  # entries extending it
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._free: list[int] = []  # allocated blocks holding no entry
        self.epoch = 0  # bumped whenever every entry is dropped (weights changed, memory freed)
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached (not prefilled)
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ the generator's calls

    @property
    def on(self) -> bool:
        return self.max_blocks > 0

    def admit(self, cache: KVCache, leaders: list[Seq], first_slot: int) -> list[int]:
        """Before their prefill: copy each leader's longest cached prompt prefix into its slot
        (leader ``j`` in slot ``first_slot + j``); returns the cached token count of each."""
        if not self.on:
            return [0] * len(leaders)
        return self.load_prompts(cache, [s.prompt for s in leaders], first_slot)

    def prefilled(
        self, cache: KVCache, leaders: list[Seq], followers: list[Seq], first_slot: int
    ) -> None:
        """After their prefill: stamp the admitted requests with ``epoch`` (their rows may be
        cached when they retire) and cache the leaders' prompts (as in :meth:`admit`)."""
        for seq in leaders + followers:
            seq.kv_epoch = self.epoch
        if self.on:
            self.store(cache, [(first_slot + j, s.prompt) for j, s in enumerate(leaders)])

    def retire(self, cache: KVCache, seq: Seq, slot: int) -> None:
        """Cache an answered request's tokens (a next turn extends them): its slot holds the
        rows of its prompt and output but the last token, kept only when computed in this
        epoch (under the current weights)."""
        if self.on and seq.kv_epoch == self.epoch:
            self.store(cache, [(slot, seq.prompt + seq.out[:-1])])

    # ------------------------------------------------------------------ counters

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys/values are held now."""
        return len(self._lru) * self.block

    @property
    def capacity_tokens(self) -> int:
        """The bound: the most tokens the pool may hold."""
        return self.max_blocks * self.block

    def stats(self) -> dict[str, int | float]:
        """Hit and query tokens since start, their ratio, held tokens and the bound, evictions
        (none when off)."""
        if not self.on:
            return {}
        return {
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_query_tokens": self.query_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / max(self.query_tokens, 1),
            "prefix_cache_tokens": self.cached_tokens,
            "prefix_cache_capacity_tokens": self.capacity_tokens,
            "prefix_cache_evicted_tokens": self.evicted_tokens,
        }

    # ------------------------------------------------------------------ lookup and load

    def match(self, tokens: list[int]) -> list[int]:
        """The pool blocks of ``tokens``' longest cached prefix (whole blocks, at least one token
        left over), touched as used; counts ``tokens`` as queried and the prefix as hit."""
        path, parent, blk = [], -1, self.block
        for i in range((len(tokens) - 1) // blk):
            b = self._entries.get((parent, tuple(tokens[i * blk : (i + 1) * blk])))
            if b is None:
                break
            path.append(b)
            parent = b
        self._touch(path)
        self.query_tokens += len(tokens)
        self.hit_tokens += len(path) * blk
        return path

    def load_prompts(self, cache: KVCache, prompts: list[list[int]], first_slot: int) -> list[int]:
        """For each prompt (prompt ``j`` going to cache slot ``first_slot + j``), copy its longest
        cached prefix into its slot; returns the cached token count of each."""
        hits = [(first_slot + j, self.match(p)) for j, p in enumerate(prompts)]
        self.load(cache, hits)
        return [len(blocks) * self.block for _, blocks in hits]

    def load(self, cache: KVCache, hits: list[tuple[int, list[int]]]) -> None:
        """Copy each ``(slot, blocks)`` of ``hits`` (blocks from :meth:`match`) into positions
        ``0 .. len(blocks) * block - 1`` of that cache slot: one gather and one scatter a layer
        for all of them."""
        hits = [(slot, blocks) for slot, blocks in hits if blocks]
        if not hits:
            return
        cache.ensure_capacity(max(len(blocks) for _, blocks in hits) * self.block)
        slots = [slot for slot, blocks in hits for _ in blocks]
        starts = [i * self.block for _, blocks in hits for i in range(len(blocks))]
        blocks = [b for _, blocks in hits for b in blocks]
        cache_rows, pool_rows = self._rows(cache, slots, starts, blocks)
        d = self.spec.head_dim
        for i in range(self.spec.n_layers):
            k, v = self.k[i].view(-1, d), self.v[i].view(-1, d)
            cache.write(i, cache_rows, k.index_select(0, pool_rows), v.index_select(0, pool_rows))

    # ------------------------------------------------------------------ store

    def store(self, cache: KVCache, items: list[tuple[int, list[int]]]) -> int:
        """Cache the whole blocks of each ``(slot, tokens)`` of ``items``, whose keys/values are
        at positions ``0 .. len(tokens) - 1`` of that cache slot (blocks already cached are only
        touched); returns the tokens newly cached. When the pool is full of entries in use by
        this call, the rest is left out."""
        skip: set[int] = set()  # blocks this call walked or filled: never evicted by it
        slots, starts, blocks = [], [], []
        try:
            for slot, tokens in items:
                for b, start in self._insert(tokens, skip):
                    slots.append(slot)
                    starts.append(start)
                    blocks.append(b)
            if blocks:
                self._copy_in(cache, slots, starts, blocks)
        except BaseException:  # entries without their keys/values (out of memory): drop all
            self.clear()
            raise
        return len(blocks) * self.block

    def _copy_in(self, cache: KVCache, slots: list[int], starts: list[int], blocks: list[int]):
        """Copy block ``blocks[j]``'s rows from slot ``slots[j]``, positions ``starts[j] ..``."""
        cache_rows, pool_rows = self._rows(cache, slots, starts, blocks)
        d = self.spec.head_dim
        for i in range(self.spec.n_layers):
            for pool, cached in ((self.k[i], cache.k[i]), (self.v[i], cache.v[i])):
                rows = cached.view(-1, d).index_select(0, cache_rows)  # not [rows]: 30x slower
                pool.view(-1, d).index_copy_(0, pool_rows, rows)

    def _insert(self, tokens: list[int], skip: set[int]) -> list[tuple[int, int]]:
        """Walk ``tokens``' whole blocks, adding an entry for each one missing (while blocks can
        be had); returns ``(pool block, first position)`` of the added ones."""
        path, added, parent, blk = [], [], -1, self.block
        for i in range(len(tokens) // blk):
            key = (parent, tuple(tokens[i * blk : (i + 1) * blk]))
            b = self._entries.get(key)
            if b is None:
                b = self._allocate(skip)
                if b is None:
                    break
                self._entries[key], self._key[b] = b, key
                if parent >= 0:
                    self._children[parent] += 1
                added.append((b, i * blk))
            path.append(b)
            skip.add(b)
            self._lru[b] = None
            self._lru.move_to_end(b)
            parent = b
        self._touch(path)
        return added

    def _allocate(self, skip: set[int]) -> int | None:
        """A pool block for a new entry: a free one, a new one (growing the pool), or the least
        recently used leaf outside ``skip``, evicted; None when none is left."""
        if not self._free and self.n_blocks < self.max_blocks:
            self._grow()
        if self._free:
            return self._free.pop()
        for b in self._lru:  # oldest first: a leaf unless an ancestor of an entry in skip
            if b not in skip and not self._children[b]:
                self._evict(b)
                return b
        return None

    def _evict(self, b: int) -> None:
        parent = self._key[b][0]
        del self._entries[self._key.pop(b)], self._lru[b]
        if parent >= 0:
            self._children[parent] -= 1
        self.evicted_tokens += self.block

    def _touch(self, path: list[int]) -> None:
        """Mark ``path`` (root first) as just used, its leaf first, so parents stay newer."""
        for b in reversed(path):
            self._lru.move_to_end(b)

    def _grow(self) -> None:
        """Double the pool (or allocate its first blocks), capped at ``max_blocks``."""
        n = min(self.max_blocks, max(2 * self.n_blocks, FIRST_BLOCKS))
        shape = (n, self.spec.n_kv_heads, self.block, self.spec.head_dim)
        for store in (self.k, self.v):
            for i in range(self.spec.n_layers):
                fresh = torch.empty(shape, device=self.device, dtype=self.dtype)
                if i < len(store):
                    fresh[: self.n_blocks] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self._free.extend(range(n - 1, self.n_blocks - 1, -1))  # lowest first out of pop()
        self.n_blocks = n

    def _rows(
        self, cache: KVCache, slots: list[int], starts: list[int], blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices ``[T * kv_heads]`` of block ``blocks[j]`` at positions ``starts[j] ..``
        of cache slot ``slots[j]``, in the cache's and in the pool's ``[-1, head_dim]`` views,
        in the same (token, head) order."""
        dev, blk, nkv = self.device, self.block, self.spec.n_kv_heads
        offsets = torch.arange(blk, device=dev)
        positions = torch.tensor(starts, device=dev)[:, None] + offsets  # [n, blk]
        slot_of = torch.tensor(slots, device=dev)[:, None].expand(-1, blk)
        cache_rows = cache.rows_of(slot_of.flatten(), positions.flatten())
        heads = torch.arange(nkv, device=dev)
        b = torch.tensor(blocks, device=dev)[:, None, None]
        pool_rows = (b * nkv + heads[None, None, :]) * blk + offsets[None, :, None]
        return cache_rows, pool_rows.flatten()

    # ------------------------------------------------------------------ invalidation

    def clear(self) -> int:
        """Drop every entry (the pool stays allocated) and bump ``epoch``; returns the tokens
        dropped."""
        dropped = self.cached_tokens
        self._entries.clear()
        self._key.clear()
        self._children.clear()
        self._lru.clear()
        self._free = list(range(self.n_blocks - 1, -1, -1))
        self.epoch += 1
        return dropped

    def release(self) -> int:
        """Drop every entry and the pool itself; returns the bytes freed (the pool grows again
        at the next store)."""
        self.clear()
        freed = sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
        self.k, self.v, self.n_blocks, self._free = [], [], 0, []
        return freed
