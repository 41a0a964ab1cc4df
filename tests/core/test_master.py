"""The master over in-process workers with stand-in engines: scheduling order, concurrency,
dispatch balance, where data lives and when it is freed, failures. No Ray, no model, no sleeps
(a barrier with a deadline proves concurrency)."""

from __future__ import annotations

import threading

import pytest
import torch

from areal.api.config.base import MicroBatchSpec
from areal.api.config.engine import TrainEngineConfig
from areal.api.mfc import MFC, ModelFn, ModelName
from areal.core.buffer import BufferFull
from areal.core.dfg import Allocation, build_graph
from areal.core.master import Master
from areal.core.worker import InProcessWorker
from areal.runtime.graphs import ACTOR, CRITIC, REF, ROLLOUT_KEYS, ppo_mfcs
from areal.utils.batch import PackedBatch


class StandIn:
    """A stand-in engine: each model function adds simple functions of its inputs and records
    what it saw (sample lengths, keys, the thread's worker)."""

    def __init__(self, name: str, seen: list, hook=None):
        self.name, self.seen, self.hook = name, seen, hook
        self.config = TrainEngineConfig(path="stand-in")
        self.lr_steps = 0

    def _record(self, fn: str, batch: PackedBatch) -> None:
        self.seen.append(
            (
                self.name,
                fn,
                threading.current_thread().name,
                batch.seqlens.tolist(),
                sorted(set(batch.tokens) | set(batch.seqs)),
                self.config.mb_spec.n_mbs,
            )
        )
        if self.hook is not None:
            self.hook(fn, batch)

    def compute_logp(self, batch, out="logp"):
        self._record("compute_logp", batch)
        return batch.with_fields(tokens={out: batch["input_ids"].float() / 10}), {"calls": 1.0}

    def compute_values(self, batch):
        self._record("compute_values", batch)
        return batch.with_fields(tokens={"values": batch["input_ids"].float()}), {}

    def compute_advantages(self, batch):
        self._record("compute_advantages", batch)
        adv = (
            batch["input_ids"].float() + batch["values"]
            if "values" in batch
            else batch["input_ids"].float()
        )
        return batch.with_fields(
            tokens={"advantages": adv, "returns": adv * 2, "token_rewards": adv},
            seqs={"seq_rewards": batch["rewards"]},
        ), {}

    def ppo_update(self, batch, logp_out=None):
        self._record("ppo_update", batch)
        key = next(k for k in ("advantages", "returns", "input_ids") if k in batch)
        out = batch if logp_out is None else batch.with_fields(tokens={logp_out: -batch[key]})
        return out, {"loss": float(batch[key].sum())}

    def step_lr_scheduler(self):
        self.lr_steps += 1


def rollout_batch(lengths: list[int], start: int = 0) -> PackedBatch:
    """A rollout-stream batch: input_ids count up from ``start``; rewards = sequence index."""
    ids, t = [], start
    for n in lengths:
        ids.append(list(range(t, t + n)))
        t += n
    tok = {
        "input_ids": ids,
        "loss_mask": [[1] * n for n in lengths],
        "logprobs": [[0.0] * n for n in lengths],
        "versions": [[0] * n for n in lengths],
    }
    seqs = {
        "rewards": [float(i) for i in range(len(lengths))],
        "no_eos": [False] * len(lengths),
        "group_index": [0] * len(lengths),
        "prompt_lens": [1] * len(lengths),
        "status_code": [0] * len(lengths),
    }
    return PackedBatch.from_sequences(tok, seqs)


def setup(mfcs, allocations, n_workers, hooks=None, **master_kw):
    seen: list = []
    hooks = hooks or {}
    models = sorted({a.model for a in allocations})
    workers = [
        InProcessWorker(
            w,
            {
                m: StandIn(str(m), seen, hooks.get(m))
                for m in models
                if any(a.model == m and w in a.workers for a in allocations)
            },
        )
        for w in range(n_workers)
    ]
    for w in workers:
        w.connect(workers)
    graph = build_graph("test", mfcs, ROLLOUT_KEYS, allocations, n_workers)
    return Master(graph, workers, **master_kw), workers, seen


def ppo_setup(**kw):
    """actor on worker 0, ref on worker 1, critic on worker 2 (each dp=1)."""
    allocs = [Allocation(ACTOR, (0,)), Allocation(REF, (1,)), Allocation(CRITIC, (2,))]
    return setup(ppo_mfcs(use_critic=True, use_ref=True, prox_logp=True), allocs, 3, **kw)


def test_an_mfc_is_dispatched_once_its_inputs_and_its_models_earlier_calls_are_done():
    master, _, _ = ppo_setup()
    master.put_batch(rollout_batch([3, 2]))
    master.step(2)
    t = master.trace
    for mid in ("actor_logp", "ref_logp", "critic_values"):
        assert t.index(("done", mid)) < t.index(("dispatch", "actor_adv"))
    for train in ("actor_train", "critic_train"):
        assert t.index(("done", "actor_adv")) < t.index(("dispatch", train))
    # the three inference calls are dispatched together, before any of them is done
    first_done = min(i for i, (e, _) in enumerate(t) if e == "done")
    assert {n for e, n in t[:first_done]} == {"actor_logp", "ref_logp", "critic_values"}


def test_independent_mfcs_on_different_workers_run_at_the_same_time():
    barrier = threading.Barrier(2, timeout=10)  # both must be inside their call at once

    def meet(fn, batch):
        if fn in ("compute_logp", "compute_values"):  # ref_logp and critic_values
            barrier.wait()

    master, _, _ = ppo_setup(hooks={REF: meet, CRITIC: meet})
    master.put_batch(rollout_batch([3, 2]))
    master.step(2)  # a serial master would break the barrier after 10 s and fail the step


def test_a_step_is_split_over_data_parallel_ranks_by_tokens_keeping_groups_whole():
    allocs = [Allocation(ACTOR, (0, 1), dp=2)]
    master, _, seen = setup(ppo_mfcs(False, False, False), allocs, 2, group_size=2)
    # groups (lengths) (2,2)=4, (5,5)=10, (1,1)=2, (3,3)=6: 10 -> r0, 6 -> r1, 4 -> r1, 2 -> r0
    master.put_batch(rollout_batch([2, 2, 5, 5, 1, 1, 3, 3]))
    master.step(8)
    adv = {
        thread.split("_")[0]: lens
        for _, fn, thread, lens, _, _ in seen
        if fn == "compute_advantages"
    }
    assert adv == {"model-worker-0": [5, 5, 1, 1], "model-worker-1": [2, 2, 3, 3]}


def test_outputs_move_worker_to_worker_and_the_master_holds_no_tensors():
    master, workers, seen = ppo_setup()
    master.put_batch(rollout_batch([3, 2]))
    stats = master.step(2)
    # critic_train (worker 2) read returns computed by actor_adv on worker 0: returns = 2 * adv,
    # adv = input_ids + values = 2 * input_ids, so the loss is sum(4 * input_ids) = 4 * (0+...+4)
    assert stats["critic_train"]["loss"] == pytest.approx(2 * 2 * sum(range(5)))
    critic_keys = next(
        keys for name, fn, *_, keys, _ in seen if name == "critic@0" and fn == "ppo_update"
    )
    assert {"returns", "values"} <= set(critic_keys)
    assert stats["actor_train"]["n_tokens"] == 5.0
    for w in workers:
        assert w._store == {}  # every field released after its last reader
    assert len(master.buffer) == 0


def test_a_key_is_freed_on_its_worker_once_its_last_reader_has_run():
    a = MFC("a", ACTOR, ModelFn.COMPUTE_LOGP, ("input_ids",), ("x",), {"out": "x"})
    b = MFC("b", ACTOR, ModelFn.COMPUTE_LOGP, ("input_ids", "x"), ("y",), {"out": "y"})
    c = MFC("c", REF, ModelFn.COMPUTE_LOGP, ("input_ids", "y"), ("z",), {"out": "z"})
    held_during_c = []
    workers_ref: list = []

    def look(fn, batch):
        held_during_c.append(
            set().union(*(set(f.tokens) | set(f.seqs) for f in workers_ref[0]._store.values()))
        )

    master, workers, _ = setup(
        [a, b, c], [Allocation(ACTOR, (0,)), Allocation(REF, (1,))], 2, hooks={REF: look}
    )
    workers_ref.append(workers[0])
    master.put_batch(rollout_batch([2, 2]))
    master.step(2)
    (held,) = held_during_c
    assert "x" not in held and "y" in held  # x's only reader (b) is done; y is being read by c


def test_steps_take_the_oldest_samples_first():
    master, _, seen = setup(ppo_mfcs(False, False, False), [Allocation(ACTOR, (0,))], 1)
    master.put_batch(rollout_batch([2], start=100))
    master.put_batch(rollout_batch([3], start=200))
    master.step(1)
    assert [lens for _, fn, _, lens, _, _ in seen if fn == "ppo_update"] == [[2]]
    master.step(1)
    assert [lens for _, fn, _, lens, _, _ in seen if fn == "ppo_update"] == [[2], [3]]


def test_a_full_buffer_refuses_a_batch_until_a_step_frees_room():
    master, workers, _ = setup(
        ppo_mfcs(False, False, False), [Allocation(ACTOR, (0,))], 1, buffer_capacity=3
    )
    master.put_batch(rollout_batch([2, 2]))
    with pytest.raises(BufferFull):
        master.put_batch(rollout_batch([1, 1]))
    assert len(workers[0]._store) == 2  # the refused batch was never placed
    master.step(2)
    master.put_batch(rollout_batch([1, 1]))


def test_training_calls_step_the_lr_schedule_and_mb_spec_applies_to_one_call_only():
    train = MFC(
        "t",
        ACTOR,
        ModelFn.PPO_UPDATE,
        ("input_ids", "loss_mask", "rewards"),
        mb_spec=MicroBatchSpec(n_mbs=3),
    )
    look = MFC("l", ACTOR, ModelFn.COMPUTE_LOGP, ("input_ids",), ("x",), {"out": "x"})
    master, workers, seen = setup([look, train], [Allocation(ACTOR, (0,))], 1)
    master.put_batch(rollout_batch([2]))
    master.step(1)
    engine = workers[0].engines[ACTOR]
    assert engine.lr_steps == 1
    assert [n_mbs for *_, n_mbs in seen] == [1, 3] and engine.config.mb_spec.n_mbs == 1


def test_a_failing_mfc_stops_the_step_naming_it_and_the_worker():
    def boom(fn, batch):
        raise RuntimeError("out of memory")

    master, _, _ = ppo_setup(hooks={CRITIC: boom})
    master.put_batch(rollout_batch([2]))
    with pytest.raises(
        RuntimeError,
        match=r"MFC 'critic_values' \(critic@0.compute_values\) failed on "
        r"worker 2: out of memory",
    ):
        master.step(1)


class WorkerGone(Exception):
    """What a dead worker's call fails with (Ray: ``RayActorError``)."""


class Mortal(InProcessWorker):
    def lost(self, error: BaseException) -> bool:
        return isinstance(error, WorkerGone)


def test_a_dead_rank_is_named_before_the_peers_whose_collective_it_broke():
    """Worker 0's collective fails at once; worker 1, whose process died, is reported 0.3 s
    later: the error names worker 1 (the cause) and then worker 0."""

    def die(fn, batch):
        if threading.current_thread().name.startswith("model-worker-1"):
            threading.Event().wait(0.3)
            raise WorkerGone("the actor died")
        raise RuntimeError("Connection reset by peer")

    seen: list = []
    workers = [
        cls(w, {CRITIC: StandIn(str(CRITIC), seen, die)})
        for w, cls in enumerate((InProcessWorker, Mortal))
    ]
    for w in workers:
        w.connect(workers)
    mfc = MFC("v", CRITIC, ModelFn.COMPUTE_VALUES, ("input_ids",), ("values",))
    graph = build_graph("test", [mfc], ROLLOUT_KEYS, [Allocation(CRITIC, (0, 1), dp=2)], 2)
    master = Master(graph, workers)
    master.put_batch(rollout_batch([2, 3]))
    try:
        with pytest.raises(RuntimeError) as failed:
            master.step(2)
    finally:
        for w in workers:
            w.close()
    assert str(failed.value).startswith(
        "MFC 'v' (critic@0.compute_values) failed on worker 1: the actor died"
    )
    assert str(failed.value).endswith("(the MFC also failed on workers [0])")
    assert isinstance(failed.value.__cause__, WorkerGone)


def test_a_stuck_mfc_stops_the_step_at_its_deadline():
    release = threading.Event()
    master, workers, _ = ppo_setup(hooks={REF: lambda fn, b: release.wait(30)}, mfc_timeout=0.5)
    master.put_batch(rollout_batch([2]))
    try:
        with pytest.raises(TimeoutError, match=r"'ref_logp' on workers \[1\]"):
            master.step(1)
    finally:
        release.set()
        for w in workers:
            w.close()


def test_workers_that_cannot_run_an_mfc_are_refused_before_any_step():
    gen = MFC("gen", ACTOR, ModelFn.GENERATE, (), ("rollout",))
    with pytest.raises(
        ValueError,
        match=r"MFC 'gen': worker 0's model 'actor@0' \(StandIn\) has no "
        r"model function generate",
    ):
        setup([gen], [Allocation(ACTOR, (0,))], 1)


def test_an_engine_adding_undeclared_keys_is_an_error_naming_the_mfc():
    class Extra(StandIn):
        def compute_values(self, batch):
            out, stats = super().compute_values(batch)
            return out.with_fields(tokens={"surprise": out["values"]}), stats

    graph = build_graph(
        "g",
        [MFC("v", ModelName("critic"), ModelFn.COMPUTE_VALUES, ("input_ids",), ("values",))],
        ROLLOUT_KEYS,
        [Allocation(CRITIC, (0,))],
        1,
    )
    worker = InProcessWorker(0, {CRITIC: Extra("critic", [])})
    worker.connect([worker])
    master = Master(graph, [worker])
    master.put_batch(rollout_batch([2]))
    with pytest.raises(
        RuntimeError,
        match=r"MFC 'v' .* added keys \['surprise', 'values'\] but the graph "
        r"declares \['values'\]",
    ):
        master.step(1)


def test_a_batch_missing_a_dataset_key_is_refused():
    master, _, _ = setup(ppo_mfcs(False, False, False), [Allocation(ACTOR, (0,))], 1)
    batch = PackedBatch.from_sequences({"input_ids": [[1, 2]]})
    with pytest.raises(ValueError, match="reads dataset keys .*'loss_mask'"):
        master.put_batch(batch)
    assert torch.is_tensor(batch["input_ids"])
