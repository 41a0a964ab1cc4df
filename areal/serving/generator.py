"""Continuous-batching generator: one scheduler thread owns the model and its KV cache.

Each loop iteration (1) runs queued control commands (pause, weight load, version set) between
steps, (2) admits waiting requests into free cache slots, (3) runs one packed forward holding a
decode token for every running request (each at its own position) and the whole prompts of the
admitted ones, so prefill shares the step's pass over the weights, and (4) retires
finished requests, refilling freed slots so running requests stay in slots ``0..B-1`` (on the
matmul attention path with the longer ones in earlier attention runs; see ``_retire``).
Requests therefore join and leave the running batch between decode steps.

Every token carries the weight version it was sampled under. A weight update does not drop the
KV cache of running requests (their earlier keys/values stay from the old weights); trainers that
need clean behaviour logprobs pause first, which aborts in-flight requests with their partials.
Thread contract: ``submit`` and the control methods may be called from any thread; only the
scheduler thread touches the model and cache.

CPU threads: ``num_threads`` sets the scheduler thread's torch thread count. A process that
serves should run its other threads single-threaded (``torch.set_num_threads(1)`` before any
torch work, as ``areal serve`` does): each thread that runs a multi-threaded op owns an OpenMP
team, and with more team threads than cores libgomp stops spin-waiting between ops, which made
a tiny-model decode step 1.45x slower here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from areal.serving.constraints import Guide
from areal.serving.cpu_attention import Mode
from areal.serving.decode_graph import DecodeOptions, StaticDecode, Toggle, load_model
from areal.serving.model import KVCache, Qwen2Forward
from areal.serving.prefix_cache import PrefixCache
from areal.serving.requests import FinishReason, GenerationResult, Seq, request_problems
from areal.serving.sampler import BatchSampler, process_stream_seed, record
from areal.serving.sampling import SamplingParams, prompt_logprobs
from areal.serving.slots import group_prompts, vacate
from areal.serving.stop_text import StopText, decoder
from areal.serving.weight_files import read_weight_dir

logger = logging.getLogger(__name__)
T = TypeVar("T")  # what a command run on the scheduler thread returns
COMMAND_TIMEOUT_S = 600.0  # deadline for a control command to run on the scheduler thread
MAX_FAILED_STEPS = 3  # consecutive failed steps after which the generator counts as broken


class GeneratorStopped(RuntimeError):
    """The scheduler is not running (crashed, stopped or not started); the message says why."""


class StepFailed(RuntimeError):
    """One generation step raised: its requests fail with this, the generator goes on."""


class NonFiniteLogits(StepFailed):
    """A request's logits held NaN or inf (a numerical fault): it fails alone, the rest go on."""


class Generator:
    """Continuous batching over a :class:`Qwen2Forward`; see the module docstring."""

    def __init__(
        self,
        model: Qwen2Forward,
        *,
        max_batch_size: int = 32,
        context_length: int | None = None,
        max_prefill_tokens: int = 8192,
        decode: Callable[[list[int]], str] | None = None,
        version: int = 0,
        num_threads: int = 0,
        share_prompts: bool = True,
        static_decode: DecodeOptions | None = None,
        prefix_cache_tokens: int = 16384,
        prefix_cache_block: int = 16,
    ):
        self.model = model
        # decode-only steps: static shapes, compiled / CUDA graphs (decode_graph.py); None: eager
        model.static = StaticDecode(model, static_decode) if static_decode else None
        self.share_prompts = share_prompts  # one prefill for identical prompts admitted together
        self.max_batch_size = max_batch_size
        self.context_length = min(
            context_length or model.spec.max_positions, model.spec.max_positions
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_text = decode
        self.num_threads = num_threads
        self.eos_token_ids = frozenset(model.spec.eos_token_ids)
        self.cache = KVCache(
            model.spec, max_batch_size, self.context_length, model.device, model.dtype
        )
        self.prefix = PrefixCache(  # earlier requests' keys/values of token blocks (0: off)
            model.spec, prefix_cache_tokens, prefix_cache_block, model.device, model.dtype
        )
        self.sampler = BatchSampler(  # unseeded requests draw from this process's stream
            model.device, model.spec.vocab_size, self.context_length, process_stream_seed()
        )
        self._version = version
        self._paused = False
        self._released = False  # KV cache given back (release_memory) until resume_memory
        self._stopping = False
        self._error: BaseException | None = None
        self.n_failed_steps = 0  # steps that raised (their requests failed, the loop went on)
        self.n_admitted = 0  # requests admitted into a cache slot since start
        self.n_nonfinite = 0  # requests failed by NaN/inf logits (the loop went on)
        self.last_nonfinite = ""  # the last such failure's message
        self._failed_in_a_row = 0
        self._cv = threading.Condition()
        self._waiting: collections.deque[Seq] = collections.deque()
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._running: list[Seq] = []  # index == cache slot
        # retired requests to answer; with overlap (CUDA) answered while the next step runs
        self._answers: list[tuple[Seq, FinishReason, int | str | None]] = []
        self.overlap = model.device.type == "cuda"
        self._thread: threading.Thread | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_attention: Mode = "auto",
        compile: Toggle = "auto",
        cuda_graphs: Toggle = "auto",
        decode_buckets: list[int] | None = None,
        **kwargs,
    ) -> Generator:
        """Load an HF model dir of a served family (weights + tokenizer for stop strings) into a
        new generator; ``compile`` / ``cuda_graphs`` / ``decode_buckets`` as the server's fields
        of those names (:func:`~.decode_graph.decode_options`)."""
        from transformers import AutoTokenizer

        batch = kwargs.get("max_batch_size", 32)
        model, options = load_model(
            path, device, dtype, cpu_attention, (compile, cuda_graphs, decode_buckets or [], batch)
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, decode=decoder(tokenizer), static_decode=options, **kwargs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Generator:
        """Start the scheduler thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="areal-generator", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (answered with finish reason abort) and stop the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"generator thread did not stop within {timeout}s")
            self._thread = None

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """The weight version new tokens are generated with."""
        return self._version

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the scheduler thread, if any."""
        return self._error

    def load(self) -> dict[str, int | float | str]:
        """Counts of running and waiting requests, :meth:`faults` and the prefix cache's
        counters (:meth:`PrefixCache.stats`; none when it is off)."""
        with self._cv:
            counts = {"running": len(self._running), "waiting": len(self._waiting)}
        counts["admitted_requests"] = self.n_admitted
        return {**counts, **self.faults(), **self.prefix.stats()}

    def faults(self) -> dict[str, int | str]:
        """Failed steps, requests failed by non-finite logits and the last such failure."""
        return {
            "failed_steps": self.n_failed_steps,
            "nonfinite_logits": self.n_nonfinite,
            "last_nonfinite": self.last_nonfinite,
        }

    def check_request(self, input_ids: list[int], params: SamplingParams) -> list[str]:
        """``"field: problem"`` strings for a request this generator cannot run."""
        return request_problems(
            input_ids,
            params,
            vocab_size=self.model.spec.vocab_size,
            context_length=self.context_length,
            eos_token_ids=self.eos_token_ids,
            has_tokenizer=self.decode_text is not None,
        )

    def submit(self, input_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one request; the future resolves to a :class:`GenerationResult`."""
        return self.submit_batch([input_ids], [params])[0]

    def submit_batch(
        self,
        batch: list[list[int]],
        params: list[SamplingParams],
        on_token: list[Callable[[int], None] | None] | None = None,
        guides: list[Guide | None] | None = None,
    ) -> list[concurrent.futures.Future]:
        """Queue several requests at once (so they can share one prefill); one future each.

        ``on_token[i]``, if given, is called on the scheduler thread with each token request
        ``i`` generates, before its future resolves (for streaming; it must be quick and not
        raise: an exception is logged and the callback dropped). ``guides[i]``, if given,
        constrains request ``i``'s tokens to its grammar (constraints.py)."""
        seqs = [self._make_seq(ids, p) for ids, p in zip(batch, params, strict=True)]
        for seq, callback in zip(seqs, on_token or []):
            seq.on_token = callback
        for seq, guide in zip(seqs, guides or []):
            seq.guide = guide
        with self._cv:
            if self._error is not None or self._stopping:
                raise GeneratorStopped(
                    f"generator is not running: {self._error or 'shutting down'}"
                )
            for seq in seqs:
                if seq.params.max_new_tokens == 0:
                    seq.resolve("length", None)
                else:
                    self._waiting.append(seq)
            self._cv.notify_all()
        return [s.future for s in seqs]

    def _make_seq(self, input_ids: list[int], params: SamplingParams) -> Seq:
        problems = self.check_request(input_ids, params)
        if problems:
            raise ValueError("; ".join(problems))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq = Seq(list(input_ids), params, fut, frozenset(stop_ids))
        if params.stop and self.decode_text is not None:
            seq.stop_text = StopText(params.stop, self.decode_text)
        return seq

    def generate(
        self,
        batch: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        timeout: float = 600.0,
    ) -> list[GenerationResult]:
        """Blocking convenience: submit all prompts and wait (deadline ``timeout`` seconds)."""
        plist = params if isinstance(params, list) else [params] * len(batch)
        futures = self.submit_batch(batch, plist)
        deadline = time.monotonic() + timeout
        return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]

    def pause(self) -> int:
        """Abort running and waiting requests (partials, finish reason abort) and hold new ones.

        Returns how many requests were aborted.
        """

        def _pause() -> int:
            self._paused = True
            return self._abort_all()

        return self._call(_pause)

    def resume(self) -> None:
        """Accept and schedule work again. Like :meth:`pause` it runs between steps, in the order
        the calls were made, so a resume called after a pause is never undone by that pause."""

        def _resume() -> None:
            self._paused = False

        self._call(_resume)

    def release_memory(self) -> int:
        """Give back the KV cache while paused (a colocated trainer steps meanwhile); returns the
        bytes dropped. The weights stay; the cache comes back at :meth:`resume_memory` (or at the
        next step that needs it)."""

        def _release() -> int:
            if not self._paused:
                raise ValueError("release_memory needs a paused server: pause generation first")
            if self.model.static is not None:  # its graphs hold the cache and a memory pool
                self.model.static.reset()
            freed = self.cache.release() + self.prefix.release()
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()  # give the freed blocks back to the device, not our pool
            self._released = True
            return freed

        return self._call(_release)

    def resume_memory(self) -> None:
        """Allocate the KV cache again after :meth:`release_memory` (no-op otherwise)."""

        def _resume() -> None:
            if self._released:
                self.cache.ensure_capacity(min(256, self.cache.max_len))
                self._released = False

        self._call(_resume)

    def update_weights(
        self, named: dict[str, torch.Tensor], version: int | None = None, complete: bool = False
    ) -> int:
        """Swap in (a subset of) HF-named weights between steps; returns the new version.

        ``version`` sets the version; None bumps it by one. Unknown names, wrong shapes, NaN/inf
        values and (``complete``) missing weights raise ValueError and keep the old weights; the
        check runs on the caller's thread, so generation goes on meanwhile.
        """
        self.model.require_loadable(named, complete)

        def _update() -> int:
            self.prefix.clear()  # its keys/values come from the old weights
            self.model.assign_weights(named)  # checked above, off this thread
            self._version = self._version + 1 if version is None else int(version)
            return self._version

        return self._call(_update)

    def update_weights_from_disk(
        self, path: str | Path, version: int | None = None, timeout: float = 600.0
    ) -> int:
        """Read an HF dir's safetensors (on the caller's thread, never the scheduler's) and swap
        them all in.

        Only regular files inside the dir are read, at most 16 bytes a parameter of this model
        in all, within ``timeout`` seconds (:mod:`areal.serving.weight_files`: a named pipe or a
        device there cannot block). A file that is not one, an unreadable one, or a partial or
        non-finite state dict raises ValueError naming it and keeps the old weights."""
        numel = sum(t.numel() for t in self.model.params.values())
        limit = 16 * numel + len(self.model.params) * 1024 + (1 << 20)  # + headers
        try:
            params = read_weight_dir(path, limit, timeout)
        except ValueError as e:
            raise ValueError(f"{path}: cannot read the weights: {e}") from None
        return self.update_weights(params, version, complete=True)

    def prompt_logprobs(
        self, input_ids: list[int], top: int = 0
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """Logprob of each prompt token given the ones before it (the first has none: None) and,
        with ``top``, each position's ``top`` most likely tokens; runs between steps."""
        problems = self.check_request(input_ids, SamplingParams(max_new_tokens=0, top_logprobs=top))
        if problems:
            raise ValueError("; ".join(problems))

        def _score() -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
            logits = self.model.score(
                torch.tensor(input_ids, dtype=torch.long, device=self.model.device)
            )
            if not bool(torch.isfinite(logits).all()):
                raise self._nonfinite(f"scoring a prompt of {len(input_ids)} tokens")
            return prompt_logprobs(logits, input_ids, top)

        return self._call(_score)

    def flush_cache(self) -> int:
        """Drop every entry of the prefix cache (between steps); returns the tokens dropped (0
        when it is off). Running requests keep their own cache rows."""
        return self._call(self.prefix.clear)

    def set_version(self, version: int) -> None:
        """Set the version stamped on tokens generated from now on."""

        def _set() -> None:
            self._version = int(version)

        self._call(_set)

    # ------------------------------------------------------------------ scheduler thread

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if self._thread is None or self._error is not None:
                raise GeneratorStopped(f"generator is not running: {self._error or 'not started'}")
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut.result(timeout=COMMAND_TIMEOUT_S)

    def _loop(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._commands or self._running) and (
                        self._paused or not self._waiting
                    ):
                        self._cv.wait(0.5)
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                if commands:  # a command sees every retired request answered
                    self._send_answers()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except Exception as e:  # reported to the caller, the loop goes on
                        fut.set_exception(e)
                admitted = self._admit()
                if admitted or self._running:
                    self._guarded_step(admitted)
        except BaseException as e:  # a model/scheduler crash: fail every request loudly
            logger.exception("generator scheduler crashed")
            self._error = e
        finally:
            self._send_answers()  # retired before the loop ended: their outputs are complete
            with self._cv:
                commands, self._commands = self._commands, []
            for _, fut in commands:
                fut.set_exception(
                    GeneratorStopped(f"generator stopped: {self._error or 'shutdown'}")
                )
            if self._error is None:
                self._abort_all()  # shutdown: partial outputs, finish reason abort
            else:
                crashed = GeneratorStopped(f"generator crashed: {self._error!r}")
                for seq in self._take_all():
                    seq.fail(crashed)

    def _admit(self) -> list[Seq]:
        """Pop waiting requests into free slots, bounded by the prefill token budget."""
        admitted: list[Seq] = []
        with self._cv:
            free = self.max_batch_size - len(self._running)
            budget = self.max_prefill_tokens
            while self._waiting and not self._paused and len(admitted) < free:
                seq = self._waiting[0]
                if seq.future.cancelled():
                    self._waiting.popleft()
                    continue
                if admitted and len(seq.prompt) > budget:
                    break
                budget -= len(seq.prompt)
                admitted.append(self._waiting.popleft())
        self.n_admitted += len(admitted)
        return admitted

    def _guarded_step(self, admitted: list[Seq]) -> None:
        """Run one step; if it raises, fail the requests of that step and go on.

        After ``MAX_FAILED_STEPS`` failed steps in a row the error propagates: the generator
        counts as broken (``error`` set, ``/health`` 503) and fails every request."""
        try:
            self._step(admitted)
            self._failed_in_a_row = 0
        except Exception as e:
            self.n_failed_steps += 1
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= MAX_FAILED_STEPS:
                raise
            logger.exception(
                "generation step failed; failing its %d request(s)", len(self._running)
            )
            failed, self._running = self._running, []  # their cache slots are free again
            for seq in failed:
                seq.fail(StepFailed(f"generation step failed: {e!r}"))

    def _step(self, admitted: list[Seq]) -> None:
        """One packed forward: a decode token for every running request plus new prompts.

        Requests admitted together with the same prompt (the samples of one group) share its
        prefill: the prompt runs once, its cache rows are copied to the others' slots and its
        last-token logits serve each of them (each samples on its own). A prompt whose first
        blocks the prefix cache holds prefills only the rest (:mod:`.prefix_cache`)."""
        dev = self.model.device
        running = self._running
        # on the host: the model reads the cache size from them, then copies them to the device
        tokens = torch.tensor([s.out[-1] for s in running], dtype=torch.long)
        positions = torch.tensor(
            [len(s.prompt) + len(s.out) - 1 for s in running], dtype=torch.long
        )
        leaders, followers, follows = group_prompts(admitted, self.share_prompts)
        B = len(running)
        self._running.extend(leaders + followers)  # first, so a crash in the step answers them too
        starts = self.prefix.admit(self.cache, leaders, B)  # cached prefixes, copied to slots
        prompts = [
            torch.tensor(s.prompt[a:], dtype=torch.long, device=dev)
            for s, a in zip(leaders, starts)
        ]
        logits = self.model.step(tokens, positions, prompts, self.cache, starts)  # [B + L, V]
        self.prefix.prefilled(self.cache, leaders, followers, B)
        for f, (seq, j) in enumerate(zip(followers, follows)):
            self.cache.move_slot(B + j, B + len(leaders) + f, len(seq.prompt))
        if followers:
            logits = torch.cat([logits, logits[[B + j for j in follows]]])
        self._sample_and_retire(logits, list(self._running), 0)

    def _sample_and_retire(self, logits: torch.Tensor, seqs: list[Seq], first_slot: int) -> None:
        """Sample one token for ``seqs`` (slots ``first_slot..``), then retire finished ones.

        A row whose logits hold NaN or inf (a numerical fault: overflowing weights or
        activations) fails its own request with :class:`NonFiniteLogits` and is counted for
        /health; the other rows sample as usual and the loop goes on. Rows of constrained
        requests sample from their grammar's masked distribution."""
        pending = self.sampler.launch(logits, seqs)  # the step's one device->host copy, queued
        if self.overlap:  # while the device runs this step: answer the last step's finished
            self._send_answers()
        out = pending.result()
        finished, faults = record(seqs, out, self._version, time.monotonic())
        for i in faults:
            finished.append((i, "abort", None, self._nonfinite(f"output token {len(seqs[i].out)}")))
        for i, reason, matched, error in sorted(finished, key=lambda r: r[0], reverse=True):
            self._retire(first_slot + i, reason, matched, error)
        if not (self.overlap and self._running):  # else answered during the next step
            self._send_answers()

    def _send_answers(self) -> None:
        """Resolve the futures of requests retired since the last call (HTTP answers follow)."""
        answers, self._answers = self._answers, []
        for seq, reason, matched in answers:
            seq.resolve(reason, matched)

    def _nonfinite(self, where: str) -> NonFiniteLogits:
        """Count a numerical fault and the error its request fails with."""
        self.n_nonfinite += 1
        self.last_nonfinite = (
            f"non-finite logits (NaN or inf) at {where} of a request under weight version "
            f"{self._version}; that request failed, the server goes on"
        )
        logger.warning("%s", self.last_nonfinite)
        return NonFiniteLogits(self.last_nonfinite)

    def _retire(
        self,
        slot: int,
        reason: FinishReason,
        matched: int | str | None,
        error: BaseException | None = None,
    ) -> None:
        """Answer the request in ``slot`` (or fail it with ``error``, clearing its cached keys,
        which may hold NaN a later occupant's attention would read) and refill the slot so
        running requests stay compact (:func:`areal.serving.slots.vacate`). An answered
        request's tokens go to the prefix cache (a next turn extends them) when its rows were
        computed under the current weights."""
        if error is not None:
            self.cache.clear_slot(slot)
            self.prefix.clear()  # its prompt's blocks, cached at its prefill, may hold NaN too
        else:
            self.prefix.retire(self.cache, self._running[slot], slot)
        seq = vacate(self._running, slot, self.cache, self.model.attention_run)
        if error is None:
            self._answers.append((seq, reason, matched))  # sent by _send_answers
        else:
            seq.fail(error)

    def _take_all(self) -> list[Seq]:
        """Remove and return every running and waiting request."""
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        seqs, self._running = self._running + waiting, []
        return seqs

    def _abort_all(self) -> int:
        """Answer every running and waiting request with its partial output (finish: abort)."""
        seqs = self._take_all()
        for s in seqs:
            s.resolve("abort", None)
        return len(seqs)
