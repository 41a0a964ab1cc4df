"""One token for every running request in one batched pass on the logits' device, and one
device->host copy per step (:class:`BatchSampler`).

Per row, on the device: the grammar mask (constraints.py), temperature, stop-token suppression
before ``min_new_tokens``, then for sampled rows top-k, top-p and min-p and one draw; the
reported logprob (sampling.py's definition: ``log_softmax(masked logits / T)``, before
truncation and suppression), the ``top_logprobs`` asked for, whether the logits were finite and
whether the token ends the request (a stop token past ``min_new_tokens``, or its length limit).
All of it comes back in one tensor copy; the host then appends tokens and checks what only it
can: grammars, stop strings (only requests that have them, incrementally: stop_text.py) and
cancelled requests.

Reproducibility without a ``torch.Generator`` per request: every request has a 64-bit noise key
(its ``seed``, or for an unseeded request one drawn from the server's counter, in a separate
half of the key space), and its ``n``-th output token is drawn with the uniform
``u = hash(key, n)`` (:func:`counter_uniform`, integer arithmetic in torch on the device) by
inverse transform sampling: the first token whose cumulative probability exceeds ``u`` times the
row's total. A row's token thus depends on its logits, key and position only, never on the other
rows of the batch. One uniform per row rather than Gumbel noise per (row, vocabulary entry):
hashing ``B x V`` counters costs a dozen integer passes over the whole logits each step, the
cumulative sum one.
"""

from __future__ import annotations

import operator
import os

import torch

from areal.serving.constraints import ConstraintFailed, advance, mask_logits
from areal.serving.requests import FinishReason, Seq
from areal.serving.sampling import IMPOSSIBLE_LOGPROB

MASK32 = 0xFFFFFFFF
UNSEEDED = 1 << 63  # unseeded requests' keys have this bit; a seed (< 2**63) never does
# integer columns of the batch's row table
TOP_K, KEY_LO, KEY_HI, MIN_NEW, LIMIT, GREEDY, N_OUT = range(7)
FINITE, STOP, LENGTH = 1, 2, 4  # the flags a step reports per row


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (murmur3's shape) on int64 holding values < 2**32; odd
    multipliers below 2**31 keep every product inside int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def counter_uniform(
    key_lo: torch.Tensor, key_hi: torch.Tensor, counter: torch.Tensor
) -> torch.Tensor:
    """Uniforms in [0, 1) (24 bits, float32), one per element: a hash of the 64-bit key (its two
    32-bit halves) and the counter (< 2**32), all int64 tensors of one shape."""
    h = _mix32((counter + 0x9E3779B9) & MASK32)
    h = _mix32(h ^ key_hi)
    h = _mix32(h ^ key_lo)
    return (h >> 8).float() * 2.0**-24


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Logits outside each row's top-k, then outside its top-p mass, then below ``min_p`` times
    its most likely token's probability, at -inf; ``top_k [B]`` is V, ``top_p [B]`` 1 and
    ``min_p [B]`` 0 where off (such a row comes back bit for bit). Top-p is measured after
    top-k; the most likely token is always kept."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(V, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    cut = (mass_before > top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    # min-p: p < min_p * p_max  <=>  logit < max logit + log(min_p) (log(0) = -inf: off)
    floor = sorted_logits[:, :1] + min_p.log()[:, None]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: per row the first token whose cumulative probability exceeds
    ``u`` times the row's total (never a token of probability 0)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)


def process_stream_seed() -> int:
    """The start of this server's stream of unseeded keys: torch's seed (``areal serve`` sets it
    from ``server.seed``) mixed with the process id, so the servers of one run (one config, one
    seed) and a restarted server never hand two unseeded requests the same noise."""
    return torch.initial_seed() ^ (os.getpid() << 24)


class BatchSampler:
    """Samples the running batch's tokens; holds the batch's row table on the device, rebuilt
    when the running requests change and advanced in place otherwise."""

    def __init__(self, device: torch.device, vocab_size: int, context_length: int, seed: int):
        self.device, self.V, self.context_length = device, vocab_size, context_length
        self._unseeded = seed * 0x9E3779B97F4A7C15  # the server's stream of unseeded keys
        self._seqs: list[Seq] = []  # the batch the table describes (held: ids stay unique)
        self._ints = torch.zeros(0, N_OUT + 1, dtype=torch.long, device=device)  # [B, 7]
        self._floats = torch.zeros(0, 3, device=device)  # [B, 3] temperature, top_p, min_p
        self._stops = torch.zeros(0, 1, dtype=torch.long, device=device)  # [B, S], -1 padded
        self._ks: list[int] = []  # top_logprobs per row
        self._truncate = self._sampled = self._guided = False
        self._suppress_steps = 0  # steps for which some row may still suppress stop tokens

    def key(self, seed: int | None) -> int:
        """A request's noise key: its seed, else the server's next unseeded key."""
        if seed is not None:
            return seed
        self._unseeded += 1
        return UNSEEDED | ((self._unseeded * 0xBF58476D1CE4E5B9) >> 7) % UNSEEDED

    def _row(self, seq: Seq) -> tuple[list[int], list[float], list[int]]:
        p, V = seq.params, self.V
        top_k = min(p.top_k, V) if p.top_k > 0 else V
        limit = min(p.max_new_tokens, self.context_length - len(seq.prompt))
        key = self.key(p.seed)  # once per request: the row is kept on the request
        ints = [top_k, key & MASK32, key >> 32, p.min_new_tokens, limit, int(p.greedy)]
        floats = [1.0 if p.greedy else p.temperature, p.top_p, p.min_p]
        return ints, floats, sorted(seq.stop_ids)

    def _rebuild(self, seqs: list[Seq]) -> None:
        rows = [s.sample_row or self._row(s) for s in seqs]
        for s, row in zip(seqs, rows):
            s.sample_row = row
        n_out = [len(s.out) for s in seqs]
        width = max([1] + [len(r[2]) for r in rows])
        dev = self.device
        self._ints = torch.tensor(
            [r[0] + [n] for r, n in zip(rows, n_out)], dtype=torch.long, device=dev
        )
        self._floats = torch.tensor([r[1] for r in rows], dtype=torch.float32, device=dev)
        stops = [r[2] + [-1] * (width - len(r[2])) for r in rows]
        self._stops = torch.tensor(stops, dtype=torch.long, device=dev)
        self._ks = [s.params.top_logprobs for s in seqs]
        self._guided = any(s.guide is not None for s in seqs)
        sampled = [s.params for s in seqs if not s.params.greedy]
        self._sampled = bool(sampled)
        self._truncate = any(
            0 < p.top_k < self.V or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled
        )
        self._suppress_steps = max(
            [s.params.min_new_tokens - n for s, n in zip(seqs, n_out) if s.stop_ids] + [0]
        )
        self._seqs = list(seqs)

    def _pick(self, scaled: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Each row's token ``[B]`` from ``scaled [B, V]`` (its logits masked, over its
        temperature, its stop tokens suppressed) and ``n [B]``, its output position: the argmax
        for greedy rows, a counter-based draw after truncation for the others."""
        tokens = scaled.argmax(dim=-1)
        if self._sampled:
            ints, floats = self._ints, self._floats
            if self._truncate:
                scaled = _truncate(scaled, ints[:, TOP_K], floats[:, 1], floats[:, 2])
            drawn = _draw(scaled, counter_uniform(ints[:, KEY_LO], ints[:, KEY_HI], n))
            tokens = torch.where(ints[:, GREEDY].bool(), tokens, drawn)
        return tokens

    def sample(self, logits: torch.Tensor, seqs: list[Seq]) -> list[list[float]]:
        """One token for each of ``seqs`` (row ``i`` of ``logits [B, V]`` is ``seqs[i]``'s);
        returns, copied to the host at once, ``[tokens, logprobs, flags]`` (:data:`FINITE`,
        :data:`STOP`, :data:`LENGTH`) and, when a row asked for ``top_logprobs``, K token ids
        then K logprobs per row (K the most asked)."""
        return self.launch(logits, seqs).result()

    def launch(self, logits: torch.Tensor, seqs: list[Seq]) -> HostCopy:
        """:meth:`sample`'s device work, queued; its result comes with :meth:`HostCopy.result`
        (the host may work meanwhile: on CUDA nothing here waits for the device)."""
        if len(seqs) != len(self._seqs) or not all(map(operator.is_, seqs, self._seqs)):
            self._rebuild(seqs)
        ints, floats = self._ints, self._floats
        n = ints[:, N_OUT]
        raw = logits.float()
        # x * 0 is 0 for finite x, NaN for NaN and inf: exactly isfinite(raw).all(-1), which
        # took 9x longer on CPU (a bool tensor and its reduction)
        finite = (raw * 0).sum(dim=-1) == 0
        if self._guided:
            raw = mask_logits(raw, [s.guide for s in seqs])
        scaled = raw / floats[:, 0:1]
        logp = torch.log_softmax(scaled, dim=-1)  # the reported distribution
        if self._suppress_steps > 0:
            self._suppress_steps -= 1
            early = (n < ints[:, MIN_NEW])[:, None]  # [B, 1]
            B, V = scaled.shape
            hit = torch.zeros(B, V + 1, dtype=torch.bool, device=scaled.device)
            cols = torch.where(self._stops >= 0, self._stops, V)  # padding: an extra column
            hit = hit.scatter_(1, cols, True)[:, :V]  # [B, V] the rows' stop ids
            scaled = scaled.masked_fill(hit & early, float("-inf"))
        tokens = self._pick(scaled, n)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        stop = (self._stops == tokens[:, None]).any(dim=-1) & (n + 1 >= ints[:, MIN_NEW])
        flags = finite.long() * FINITE + stop.long() * STOP + (n + 1 >= ints[:, LIMIT]) * LENGTH
        out = [tokens.double(), chosen.double(), flags.double()]
        if any(self._ks):
            top = logp.topk(max(self._ks), dim=-1)  # a masked token's -inf: OpenAI's floor
            out += [*top.indices.double().T, *top.values.clamp(min=IMPOSSIBLE_LOGPROB).double().T]
        ints[:, N_OUT] += 1
        return HostCopy(torch.stack(out))  # the step's one device->host copy


class HostCopy:
    """A device tensor on its way to the host: on CUDA copied ``non_blocking`` into pinned memory
    with an event recorded after the copy, so :meth:`result` waits for that copy only; on CPU
    the tensor itself."""

    def __init__(self, t: torch.Tensor):
        self._event = None
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            t = host
        self._host = t

    def result(self) -> list[list[float]]:
        """The copied values as lists (waits for the copy)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


Finished = tuple[int, FinishReason, int | str | None, BaseException | None]  # row, how, error


def record(
    seqs: list[Seq], out: list[list[float]], version: int, now: float
) -> tuple[list[Finished], list[int]]:
    """Append each row's token of :meth:`BatchSampler.sample`'s ``out`` to its request; returns
    the rows that finished (row, reason, the stop token or string matched, the error a request
    fails with) and the rows whose logits were not finite (no token appended)."""
    tokens, logprobs, flags = out[0], out[1], out[2]
    K = (len(out) - 3) // 2
    finished: list[Finished] = []
    faults: list[int] = []
    for i, s, tok, lp, flag in zip(range(len(seqs)), seqs, tokens, logprobs, flags):
        if flag != FINITE and not int(flag) & FINITE:  # NaN or inf logits: no token
            faults.append(i)
            continue
        s.append_token(int(tok), lp, version, now)
        if s.params.top_logprobs:
            s.tops.append(_tops(out, i, K, s.params.top_logprobs))
        if flag == FINITE and s.guide is None and s.stop_text is None:  # the common row
            if s.cancelled:  # the client went away
                finished.append((i, "abort", None, None))
            continue
        done = _finish(s, int(tok), int(flag))
        if done is not None:
            finished.append((i, *done))
    return finished, faults


def _tops(out: list[list[float]], i: int, K: int, k: int) -> list[tuple[int, float]]:
    """Row ``i``'s ``k`` most likely (token, logprob) from a step's ``out``."""
    return [(int(out[3 + j][i]), out[3 + K + j][i]) for j in range(k)]


def _finish(
    s: Seq, tok: int, flag: int
) -> tuple[FinishReason, int | str | None, BaseException | None] | None:
    """How ``s`` ends after its new token ``tok`` (flags of :meth:`BatchSampler.sample`), or
    None while it goes on: its grammar complete or failed, a stop token, a stop string, its
    length, or its client gone."""
    try:
        complete = s.guide is not None and advance(s.guide, tok)
    except ConstraintFailed as e:  # this request's grammar failed: it fails alone
        return "abort", None, e
    if complete:  # the grammar accepted tok as the last token: the output ends here
        return "stop", tok if tok in s.stop_ids else None, None
    if flag & STOP:
        return "stop", tok, None
    if s.stop_text is not None:  # read at every token, searched past min_new_tokens
        hit = s.stop_text.search(s.out, len(s.out) >= s.params.min_new_tokens)
        if hit is not None:
            return "stop", hit, None
    if flag & LENGTH:
        return "length", None, None
    return ("abort", None, None) if s.cancelled else None
