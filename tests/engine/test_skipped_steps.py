"""Tier 1: the actor's accounting of train steps whose every optimizer update was skipped
(``actor.max_skipped_steps``): a warning each, the run stopped at the limit naming the reason."""

from __future__ import annotations

import logging

import pytest
import torch

from areal.engine.ppo import SkippedSteps, SkippedUpdatesError, skip_reason
from areal.utils.batch import PackedBatch

SKIPPED = {"update_skipped": 1.0, "grad_norm": float("nan"), "loss": float("nan")}
TAKEN = {"update_skipped": 0.0, "grad_norm": 0.5, "loss": 0.1}


def _batch(rewards: list[float]) -> PackedBatch:
    ids = [[1, 2, 3]] * len(rewards)
    return PackedBatch.from_sequences(
        {"input_ids": ids, "loss_mask": [[0, 1, 1]] * len(rewards)}, {"rewards": rewards}
    )


def test_the_limit_of_all_skipped_steps_in_a_row_stops_the_run_naming_non_finite_rewards(caplog):
    watch, batch = SkippedSteps(limit=3), _batch([1.0, float("inf")])
    with caplog.at_level(logging.WARNING, logger="areal.ppo"):
        watch.observe([SKIPPED, SKIPPED], batch)  # every minibatch skipped: a warning
        watch.observe([SKIPPED], batch)
    assert watch.in_a_row == 2 and caplog.text.count("skipped every optimizer update") == 2
    with pytest.raises(SkippedUpdatesError) as e:
        watch.observe([SKIPPED], batch)
    msg = str(e.value)
    assert "\n" not in msg and "3 train steps in a row" in msg and "max_skipped_steps=3" in msg
    assert "1 non-finite rewards in the batch" in msg and "reward.non_finite" in msg


def test_a_taken_update_resets_the_count_and_a_partly_skipped_step_is_not_counted():
    watch, batch = SkippedSteps(limit=2), _batch([1.0, 0.0])
    watch.observe([SKIPPED], batch)
    watch.observe([SKIPPED, TAKEN], batch)  # one minibatch trained: the step moved the weights
    assert watch.in_a_row == 0
    watch.observe([SKIPPED], batch)
    watch.observe([TAKEN], batch)
    watch.observe([SKIPPED], batch)
    assert watch.in_a_row == 1  # never 2 in a row: no stop


def test_limit_zero_never_stops():
    watch = SkippedSteps(limit=0)
    for _ in range(10):
        watch.observe([SKIPPED], _batch([0.0]))
    assert watch.in_a_row == 10


def test_skip_reason_says_the_model_diverged_when_the_inputs_are_finite():
    why = skip_reason(SKIPPED, _batch([1.0, 0.0]))
    assert why.startswith("grad norm nan, loss nan") and "model diverged" in why
    batch = _batch([1.0, 0.0]).with_fields(tokens={"advantages": torch.full((6,), float("nan"))})
    assert "6 non-finite advantages" in skip_reason(SKIPPED, batch)
