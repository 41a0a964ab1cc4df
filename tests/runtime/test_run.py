"""Tier 2 (one process, no model weights): the run's step-loop rules. ``Run.resume`` registers
what a recover checkpoint holds and restores it in order; ``Run.checkpoint`` saves it under the
keys the state file has always had; ``Run.steps`` tells the saver and evaluator the last step.
``make_run`` (tests/conftest.py): a Run over RUN_DIR=tmp_path/e/t with recover.mode=resume."""

from __future__ import annotations

import pytest

from areal.api.io import SaveLoadMeta
from areal.api.protocols import Checkpointable, Persistent, Publisher, StateDict


class Log(list):
    """Every call of the fakes below, in order."""


class Model(Persistent):
    def __init__(self, log: Log):
        self.log = log

    def save(self, meta: SaveLoadMeta) -> None:
        self.log.append(("model", "save", meta.weight_format))

    def load(self, meta: SaveLoadMeta) -> None:
        self.log.append(("model", "load", meta.weight_format))


class Part(Checkpointable):
    def __init__(self, log: Log, name: str, value: int):
        self.log, self.name, self.value = log, name, value

    def state_dict(self) -> StateDict:
        return {"value": self.value}

    def load_state_dict(self, state: StateDict) -> None:
        self.log.append((self.name, "load", state["value"]))


class Weights(Publisher):
    def __init__(self, log: Log, version: int):
        self.log, self._version = log, version

    @property
    def version(self) -> int:
        return self._version

    def publish(self, version: int) -> int:
        self.log.append(("weights", "publish", version))
        return version


def test_resume_restores_what_checkpoint_saved_in_order_and_returns_its_step(make_run):
    first, log = make_run(), Log()
    parts = {"loader": Part(log, "loader", 5), "executor": Part(log, "executor", 6)}
    assert first.resume({"model": Model(log)}, **parts, weights=Weights(log, 7)) == 0
    assert log == []  # nothing to resume from: nothing loaded, nothing published
    first.checkpoint(3)
    assert log == [("model", "save", "dcp")]

    second, log = make_run(), Log()
    parts = {"loader": Part(log, "loader", 0), "executor": Part(log, "executor", 0)}
    assert second.resume({"model": Model(log)}, **parts, weights=Weights(log, 0)) == 3
    assert log == [
        ("model", "load", "dcp"),
        ("loader", "load", 5),
        ("executor", "load", 6),
        ("weights", "publish", 7),  # the servers get the checkpoint's weights and version
    ]


def test_checkpoint_keeps_the_state_file_keys_of_the_entry_scripts(make_run):
    run, log = make_run(), Log()
    run.resume({}, loader=Part(log, "loader", 1), manager=Part(log, "manager", 2))
    run.checkpoint(1)
    state = make_run().load_recover({})
    assert state["dataloader"] == {"value": 1} and state["manager"] == {"value": 2}
    assert "version" not in state and "executor" not in state and state["step"] == 1


def test_checkpoint_before_resume_is_refused_naming_the_fix(make_run):
    with pytest.raises(RuntimeError, match="Run.checkpoint before Run.resume"):
        make_run().checkpoint(1)


def test_steps_tell_the_saver_and_evaluator_the_last_step(make_run):
    run = make_run("saver.freq_steps=4", "evaluator.freq_steps=null", "recover.freq_steps=null")
    fired = [
        (step, epoch_done, run.saver.check(step, epoch_done), run.evaluator.check(step))
        for step, epoch_done in run.steps(1, 6, steps_per_epoch=3)
    ]
    assert fired == [
        (2, False, False, False),
        (3, True, False, False),
        (4, False, True, False),
        (5, False, False, False),
        (6, True, True, True),  # the last step: saved and evaluated whatever the frequency
    ]
    assert not run.recover_timer.check(6)  # recover checkpoints keep their own schedule


def test_end_at_makes_the_running_step_the_last_for_the_loop_and_every_timer(make_run):
    """`areal core stop`'s path: step 3 of 10 becomes the last; saver, evaluator and (recovery
    on) the recover timer fire there though none is due."""
    run = make_run(
        "saver.freq_steps=4", "evaluator.freq_steps=null", "recover.freq_steps=null"
    )  # make_run's recover.mode is resume
    fired = []
    for step, _ in run.steps(0, 10, steps_per_epoch=5):
        if step == 3:
            run.end_at(step)
        timers = (run.saver, run.evaluator, run.recover_timer)
        fired.append((step, *(timer.check(step) for timer in timers)))
    assert fired == [
        (1, False, False, False),
        (2, False, False, False),
        (3, True, True, True),
    ]
    off = make_run("recover.mode=disabled", "recover.freq_steps=null")
    for step, _ in off.steps(0, 10, steps_per_epoch=5):
        off.end_at(step)
        assert not off.recover_timer.check(step)  # no recovery: no recover checkpoint
    assert step == 1


def test_a_resume_after_a_kill_mid_write_keeps_stats_and_trained_samples_valid_jsonl(make_run):
    import json

    first = make_run()
    first.resume({})
    for step in (1, 2):
        first.log_trained(step, [f"s{step}"])
        first.commit(step, 3, {"loss": float(step)})
    first.checkpoint(2)
    first.stats_logger.close()
    for name in ("stats.jsonl", "trained_samples-rank0.jsonl"):  # killed in the middle of step 3
        with open(first.run_dir / name, "a") as f:
            f.write('{"step": 3, "lo')

    second = make_run()
    assert second.resume({}) == 2  # no crash on the half-written lines
    second.log_trained(3, ["s3"])
    second.commit(3, 3, {"loss": 3.0})
    second.stats_logger.close()
    for name in ("stats.jsonl", "trained_samples-rank0.jsonl"):
        lines = (second.run_dir / name).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3], name
