"""Sampling for the API: our generator, each sampling session pinned to one weight snapshot.

A snapshot is an HF dir (the base model, or an export of ``save_weights_for_sampler``). The
generator holds one snapshot at a time: a thread takes the queued requests of the oldest one's
snapshot (all of them, so they share the generator's batch), loads that snapshot if it is not
the one held (:meth:`Generator.update_weights_from_disk`), runs them and answers, then the next.
``num_samples`` copies of a prompt get seeds ``seed, seed + 1, ...`` as our server's ``n`` does,
so each sample equals our server's answer to the same request.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from tinker import types

from areal.serving.generator import Generator
from areal.serving.requests import GenerationResult
from areal.serving.sampling import SamplingParams
from areal.tinker.futures import Entry, Reply
from areal.tinker.wire import ApiError, Sequence, bad, encode_sample

PROTO = "application/x-protobuf"


@dataclass
class SampleJob:
    weights_dir: str
    prompt: list[int]
    params: list[SamplingParams]  # one per sample
    prompt_logprobs: bool
    entry: Entry


def sampling_params(
    req: types.SampleRequest, n_prompt: int, context: int, default_max: int
) -> list[SamplingParams]:
    """Our sampling params for each of ``req.num_samples`` samples (400 naming a bad field)."""
    sp = req.sampling_params
    if req.num_samples < 1:
        raise bad(f"num_samples: must be >= 1, got {req.num_samples}")
    room = context - n_prompt
    if room < 1:
        raise bad(f"prompt: {n_prompt} tokens leave no room in the model's context of {context}")
    max_new = min(default_max, room) if sp.max_tokens is None else sp.max_tokens
    if max_new < 1 or max_new > room:
        raise bad(f"sampling_params.max_tokens: {max_new} must be in [1, {room}] for this prompt")
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    ignore_eos = False
    if isinstance(sp.stop, str):
        stop = (sp.stop,)
    elif sp.stop is not None:
        values = list(sp.stop)
        ignore_eos = not values  # [] disables every stop token, EOS included
        if all(isinstance(v, int) for v in values):
            stop_ids = tuple(int(v) for v in values)
        elif all(isinstance(v, str) for v in values):
            stop = tuple(str(v) for v in values)
        else:
            raise bad("sampling_params.stop: mixes strings and token ids; send one kind")
    base = SamplingParams(
        max_new_tokens=max_new,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        seed=sp.seed,
    )
    problems = base.problems()
    if problems:
        raise bad("sampling_params." + "; sampling_params.".join(problems))
    seeds = [None if sp.seed is None else sp.seed + i for i in range(req.num_samples)]
    return [SamplingParams(**{**base.__dict__, "seed": s}) for s in seeds]


def _sequence(result: GenerationResult) -> Sequence:
    return Sequence(result.output_ids, result.output_logprobs, result.finish_reason == "stop")


class PinnedSampler:
    """The generator behind every sampling session (see the module docstring)."""

    def __init__(self, generator: Generator, base_dir: str):
        self.generator = generator
        self.held = base_dir  # the snapshot the generator holds
        self._queue: queue.Queue[SampleJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="tinker-sampler", daemon=True)
        self._thread.start()

    def submit(self, job: SampleJob) -> None:
        self._queue.put(job)

    def _take(self) -> list[SampleJob] | None:
        """The oldest job and every queued one with its snapshot (the rest go back, in order)."""
        first = self._queue.get()
        if first is None:
            return None
        jobs, rest = [first], []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                rest.append(job)
                break
            (jobs if job.weights_dir == first.weights_dir else rest).append(job)
        for job in rest:
            self._queue.put(job)
        return jobs

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                self._hold(jobs[0].weights_dir)
            except Exception as e:  # unreadable snapshot: its requests fail, the rest go on
                for job in jobs:
                    job.entry.future.set_exception(e)
                continue
            flat = [(job, p) for job in jobs for p in job.params]
            try:
                futures = self.generator.submit_batch(
                    [j.prompt for j, _ in flat], [p for _, p in flat]
                )
            except ValueError as e:  # the generator's own checks of a request
                for job in jobs:
                    job.entry.future.set_exception(bad(str(e)))
                continue
            self._answer(jobs, futures)

    def _hold(self, weights_dir: str) -> None:
        if weights_dir != self.held:
            self.generator.update_weights_from_disk(weights_dir)
            self.held = weights_dir

    def _answer(self, jobs: list[SampleJob], futures: list) -> None:
        i = 0
        for job in jobs:
            mine, i = futures[i : i + len(job.params)], i + len(job.params)
            try:
                seqs = [_sequence(f.result()) for f in mine]
                prompt_lp = None
                if job.prompt_logprobs:
                    prompt_lp, _ = self.generator.prompt_logprobs(job.prompt)
                job.entry.future.set_result(Reply(encode_sample(seqs, prompt_lp), PROTO))
            except ValueError as e:
                job.entry.future.set_exception(ApiError(400, str(e)))
            except Exception as e:  # e.g. non-finite logits: this request fails, others go on
                job.entry.future.set_exception(e)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(60)
        self.generator.shutdown()
