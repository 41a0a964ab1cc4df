"""Hang detection (``core.health_timeout``, :mod:`areal.core.health`; issue 38).

Tier 1: the verdict (:class:`ProbeClock`) with hand-picked times, and what the master is said
to run (:class:`MFCActivity`).

Tier 2 (slow): one ``areal core async-ppo`` run under the real local launcher, three faults.
The generation manager is SIGKILLed: Ray restarts it from its record and the run goes on (the
version one up every step, each prompt trained once). A rollout worker is stopped (SIGSTOP:
alive, silent): the master's hang watch names it within ``health_timeout`` (plus one probe
period), kills it, Ray restarts it, its work is redone and the run goes on. Then a model worker
is stopped: it is named the same way, killed, the step fails naming it, and the run stops with
nothing left behind.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from areal.core.health import HangWatch, MFCActivity, ProbeClock, Watched

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_async_ppo import ASYNC, start, status  # noqa: E402
from test_sync_ppo import RUN_TIMEOUT, cluster_runs  # noqa: E402,F401  (the fixture)

from launch_harness import effective_ids, train_steps  # noqa: E402  (on the path now)


def test_an_actor_is_hung_after_timeout_seconds_of_silence_once_it_has_answered():
    clock = ProbeClock(timeout=10.0)
    clock.sent("w", 0.0)
    assert clock.hung(100.0) == []  # never answered yet (starting): not judged
    clock.answered("w")
    clock.sent("w", 20.0)
    assert clock.hung(29.9) == []
    assert clock.hung(30.0) == [("w", 10.0)]  # 30 - 20 = 10 s silent >= 10 s
    clock.failed("w")  # killed (or it died): not judged while it restarts
    clock.sent("w", 31.0)
    assert clock.hung(60.0) == []
    clock.answered("w")  # back
    clock.sent("w", 61.0)
    assert clock.hung(75.0) == [("w", 14.0)]
    clock.forget("w")
    assert clock.hung(1000.0) == []
    with pytest.raises(ValueError, match="health_timeout must be > 0 seconds, got 0"):
        ProbeClock(0)


def test_the_activity_names_the_mfcs_running_and_for_how_long():
    trace: list[tuple[str, str]] = []
    activity = MFCActivity(trace)
    assert activity(0.0) == "between MFCs"
    trace += [("dispatch", "actor_logp"), ("dispatch", "ref_logp")]
    assert activity(5.0) == "while the master ran MFC 'actor_logp' for 0 s, 'ref_logp' for 0 s"
    trace += [("done", "ref_logp")]
    assert activity(12.0) == "while the master ran MFC 'actor_logp' for 7 s"  # 12 - 5
    trace += [("done", "actor_logp")]
    assert activity(13.0) == "between MFCs"


class FakeRay:
    """What the watch asks of Ray: probes answered or not (by the test), kills recorded."""

    class exceptions:  # noqa: N801 -- mirrors ray.exceptions
        class RayActorError(Exception):
            pass

    def __init__(self):
        self.answers: dict[str, object] = {}  # actor -> its pid, or an exception (it died)
        self.killed: list[tuple[str, bool]] = []

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if r in self.answers], []

    def get(self, ref, timeout):
        answer = self.answers.pop(ref)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def kill(self, handle, no_restart):
        self.killed.append((handle.name, no_restart))


class FakeHandle:
    def __init__(self, name: str):
        self.name, self.pid = name, self

    def remote(self) -> str:  # the probe's "ObjectRef" is the actor's name
        return self.name


def test_the_watch_kills_an_actor_silent_for_the_timeout_and_names_it():
    actors = {
        "model worker 1": Watched(FakeHandle("model worker 1"), False, "the run stops"),
        "rollout worker 0": Watched(FakeHandle("rollout worker 0"), True, "Ray restarts it"),
    }
    watch = HangWatch(lambda: dict(actors), 10.0, lambda now: "between MFCs", period=1.0)
    fake = watch._ray = FakeRay()
    watch.tick(0.0)  # probes out
    fake.answers = {"model worker 1": 101, "rollout worker 0": 200}
    watch.tick(1.0)  # both answered (alive, judged from now on); new probes out at t=1
    fake.answers = {"rollout worker 0": 200}  # the model worker is silent from t=1 on
    watch.tick(10.9)
    assert fake.killed == []  # 9.9 s < 10 s
    watch.tick(11.0)
    assert fake.killed == [("model worker 1", True)]  # not restartable: no_restart=True
    assert watch.named == [
        "model worker 1 (pid 101) is hung: no answer for 10.0 s (core.health_timeout=10 s) "
        "between MFCs; killed: the run stops"
    ]
    # a killed (or dead) actor is not judged again until it answers
    fake.answers = {"rollout worker 0": FakeRay.exceptions.RayActorError("restarting")}
    watch.tick(12.0)
    watch.tick(40.0)
    assert len(fake.killed) == 1
    del actors["rollout worker 0"]  # stopped by the master (drained)
    watch.tick(41.0)
    assert "rollout worker 0" not in watch.clock.probes
    watch.check()  # the watch itself did not fail


HUNG = re.compile(r"(\w+ worker \d+) \(pid (\d+)\) is hung: no answer for ([\d.]+) s")


def hung_lines(run_dir: Path) -> list[tuple[str, int, float]]:
    log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    return [(m[1], int(m[2]), float(m[3])) for m in HUNG.finditer(log)]


def until_status(launch, run_dir: Path, what, label: str) -> dict:
    """Wait for RUN_DIR/core_status.json to satisfy ``what`` while the run goes on."""
    launch.wait(RUN_TIMEOUT, until=lambda: (st := status(run_dir)) is not None and what(st))
    assert launch.proc.poll() is None, f"the run ended before {label}:\n{launch.output()}"
    return status(run_dir)


@pytest.mark.slow
def test_a_killed_manager_and_a_hung_rollout_worker_recover_and_a_hung_model_worker_stops_the_run(
    cluster_runs, tiny_model_dir
):
    """One run, three faults (one launch is the cost of the three), on the session's Ray
    cluster."""
    timeout, period = 8.0, 2.0  # seconds; probes every min(2, 8 / 4) = 2 s
    t0 = time.monotonic()
    launch, run_dir = start(
        cluster_runs,
        "faults",
        [f"actor.path={tiny_model_dir}", *ASYNC, "total_train_steps=200",
         "rollout.max_staleness=1", f"core.health_timeout={timeout}"],
    )  # fmt: skip
    # 1. the manager SIGKILLed: Ray restarts it from its record and the run goes on
    st = until_status(launch, run_dir, lambda st: st["step"] >= 2, "step 2")
    manager, killed_at = st["manager_pid"], st["step"]
    os.kill(manager, signal.SIGKILL)
    st = until_status(
        launch,
        run_dir,
        lambda st: st["manager_pid"] != manager and st["step"] >= killed_at + 2,
        "two steps with the restarted manager",
    )
    assert st["manager"]["manager/restarts"] == 1
    # 2. a rollout worker stopped (alive, silent): named within health_timeout, killed,
    # restarted by Ray, its rollouts redone, the run goes on
    victim, at = st["workers"][1]["pid"], st["step"]
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    launch.wait(RUN_TIMEOUT, until=lambda: hung_lines(run_dir))
    named = time.monotonic() - stopped
    assert hung_lines(run_dir)[0][:2] == ("rollout worker 1", victim)
    assert timeout <= hung_lines(run_dir)[0][2] <= timeout + period + 1
    st = until_status(
        launch,
        run_dir,
        lambda st: st["step"] >= at + 2 and st["workers"][1]["pid"] != victim,
        "two steps with the restarted rollout worker",
    )
    assert st["manager"]["rollout_worker/1/restarts"] == 1
    # 3. a model worker stopped: named, killed, the step fails and the run stops, no survivor
    model = st["model_worker_pids"][1]
    os.kill(model, signal.SIGSTOP)
    assert launch.wait(RUN_TIMEOUT) != 0
    launch.assert_no_survivors()  # the stopped process too
    lines = hung_lines(run_dir)
    assert len(lines) == 2 and lines[1][:2] == ("model worker 1", model), lines
    assert timeout <= lines[1][2] <= timeout + period + 1
    # every step: one weight update (the version went on across the manager's restart), lags
    # within the bound, each prompt trained once
    steps = train_steps(run_dir)
    assert sorted(steps) == list(range(1, len(steps) + 1))
    assert all(s["manager/version"] == n and s["core/lag/max"] <= 1 for n, s in steps.items())
    ids = [i for r in effective_ids(run_dir).values() for i in r]
    assert len(ids) == 2 * len(steps) and len(set(ids)) == len(ids)
    print(
        f"manager killed after step {killed_at}; rollout worker named {named:.1f} s after "
        f"SIGSTOP; {len(steps)} steps; the test took {time.monotonic() - t0:.0f} s"
    )
