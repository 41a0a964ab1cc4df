"""RewardRunner: deadline kills and replaces a worker, crashes are counted, policy applies."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest

from areal.api.config.reward import RewardConfig
from areal.reward.runner import FailureTracker, RewardFailureError, RewardRunner


def slow_if_negative(x: float) -> float:
    """Test reward: sleeps forever on negative input, raises on zero, else returns x."""
    if x < 0:
        time.sleep(3600)
    if x == 0:
        raise ValueError("zero is not allowed")
    return x


def die(_: float) -> float:
    os._exit(3)


def nan_or_huge(x: float) -> float:
    """Test reward: NaN on 7, 1e308 (finite in float64, inf in float32) on 8, else x."""
    return {7.0: float("nan"), 8.0: 1e308}.get(x, x)


# ----------------------------------------------------------------------------- tier 1


def test_tracker_counts_and_resets_per_batch():
    t = FailureTracker(max_failure_fraction=0.5)
    t.record("a", None)
    t.record("b", "boom")
    t.record("c", "late", timed_out=True)
    t.record("d", None)
    # 2 failed of 4 = 0.5, not more than 0.5: allowed
    stats = t.commit()
    assert stats["reward/n_calls"] == 4 and stats["reward/n_failed"] == 2
    assert stats["reward/n_timeouts"] == 1 and stats["reward/failure_fraction"] == 0.5
    assert t.commit()["reward/n_calls"] == 0


def test_tracker_stops_the_run_past_the_failure_fraction():
    t = FailureTracker(max_failure_fraction=0.25)
    for sid, err in [("a", None), ("b", "boom"), ("c", "boom"), ("d", None)]:
        t.record(sid, err)
    with pytest.raises(RewardFailureError, match="2 of 4.*b: boom"):
        t.commit()  # 2/4 = 0.5 > 0.25


def test_tracker_raise_policy_stops_at_the_first_failure():
    t = FailureTracker(max_failure_fraction=1.0, policy="raise")
    t.record("a", None)
    with pytest.raises(RewardFailureError, match="sample b"):
        t.record("b", "boom")


def test_tracker_counts_non_finite_rewards_under_each_policy():
    drop = FailureTracker(max_failure_fraction=1.0, non_finite="drop")
    zero = FailureTracker(max_failure_fraction=1.0, non_finite="zero")
    # drop: a failed call (1 of 2); zero: scored 0 and trained on, not a failure
    for t, failed in ((drop, 1.0), (zero, 0.0)):
        t.record("a", None)
        t.record("b", "nan is not finite", non_finite=True)
        stats = t.commit()
        assert stats["reward/n_non_finite"] == 1.0 and stats["reward/n_failed"] == failed
    error = FailureTracker(max_failure_fraction=1.0, policy="zero", non_finite="error")
    with pytest.raises(RewardFailureError, match="sample b nan is not finite.*non_finite=error"):
        error.record("b", "nan is not finite", non_finite=True)


# ----------------------------------------------------------------------------- tier 2


@pytest.mark.parametrize("policy", ["drop", "zero"])
def test_nan_and_float32_overflow_rewards_are_counted_and_never_reach_training(policy, caplog):
    cfg = RewardConfig(n_workers=1, max_failure_fraction=0.5, non_finite=policy)
    with RewardRunner(nan_or_huge, cfg) as runner:
        with caplog.at_level(logging.WARNING, logger="areal.reward"):
            outcomes = [runner.score(f"s{i}", float(i)) for i in range(1, 41)]  # 2 bad of 40
        stats = runner.commit_batch()
    bad = [outcomes[6], outcomes[7]]  # x = 7 (NaN) and 8 (1e308)
    assert all(o.reward == 0.0 for o in bad)
    assert [o.ok for o in bad] == [policy == "zero"] * 2  # drop: a failed call, not trained on
    assert all(o.ok and o.reward == i for i, o in enumerate(outcomes, 1) if i not in (7, 8))
    assert stats["reward/n_non_finite"] == 2.0
    assert stats["reward/n_failed"] == (2.0 if policy == "drop" else 0.0)
    assert "s7" in caplog.text and "s8" in caplog.text and "1e+308" in caplog.text


def test_non_finite_error_policy_stops_at_the_first_non_finite_reward():
    cfg = RewardConfig(n_workers=1, non_finite="error")
    with RewardRunner(nan_or_huge, cfg) as runner:
        assert runner.call("s1", 1.0) == 1.0
        with pytest.raises(RewardFailureError, match="sample s8 1e\\+308 is not finite as float32"):
            runner.call("s8", 8.0)


def test_hung_call_is_killed_replaced_and_reported(caplog):
    cfg = RewardConfig(n_workers=2, timeout=3.0, max_failure_fraction=0.3)
    with RewardRunner(slow_if_negative, cfg) as runner:
        runner.map(["warm0", "warm1"], [1.0, 1.0])  # workers imported and ready
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="areal.reward"):
            results = runner.map(["ok", "hung", "bad"], [2.0, -1.0, 0.0])
        took = time.monotonic() - start
        assert results == [2.0, 0.0, 0.0]
        assert took < 10  # the 3 s deadline, not the hour the call asked for
        assert "hung" in caplog.text and "deadline" in caplog.text
        assert "bad" in caplog.text and "ValueError" in caplog.text
        # 2 failed of 5 calls (warm-up included) = 0.4 > 0.3: the run stops with a message
        with pytest.raises(RewardFailureError, match="2 of 5"):
            runner.commit_batch()
        assert runner.call("after", 5.0) == 5.0  # the replacement worker serves
        assert runner.commit_batch()["reward/n_failed"] == 0


def test_worker_crash_scores_zero_and_is_counted():
    with RewardRunner(die, RewardConfig(n_workers=1, max_failure_fraction=1.0)) as runner:
        outcome = runner.score("crash", 1.0)
        assert outcome.reward == 0.0 and "died" in outcome.error
        assert runner.commit_batch()["reward/n_errors"] == 1


def test_async_scoring_runs_calls_concurrently():
    async def main(runner):
        return await asyncio.gather(*(runner.ascore(f"s{i}", float(i + 1)) for i in range(4)))

    with RewardRunner(slow_if_negative, RewardConfig(n_workers=2)) as runner:
        assert [o.reward for o in asyncio.run(main(runner))] == [1.0, 2.0, 3.0, 4.0]


def test_a_worker_imports_the_rewards_module_not_the_callers_main_script(tmp_path):
    """A spawn child would re-import the training script (torch, the engines: seconds of CPU per
    worker); areal.reward.worker imports only the reward's own module."""
    (tmp_path / "heavy_marker.py").write_text("LOADED = True\n")
    (tmp_path / "rew.py").write_text(
        "import sys\n\ndef fresh(_):\n    return float('heavy_marker' not in sys.modules)\n"
    )
    (tmp_path / "train.py").write_text(
        "import heavy_marker\n"
        "from areal.api.config.reward import RewardConfig\n"
        "from areal.reward.runner import RewardRunner\n"
        "from rew import fresh\n"
        "if __name__ == '__main__':\n"
        "    with RewardRunner(fresh, RewardConfig(n_workers=1)) as runner:\n"
        "        print(runner.call('s0', 0.0))\n"
    )
    out = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0"], out.stdout  # the script's import did not reach it
