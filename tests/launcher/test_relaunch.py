"""The relaunch loop and the log pump, in-process (tier 1/2: no servers, no torchrun).

``launch`` runs a fake ``run_once`` that records each attempt's failure as the supervisor does;
the log pump runs a real child whose log file fails with ENOSPC.
"""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import pytest

from areal.launcher import procs
from areal.launcher.common import launch, same_cause
from areal.launcher.local import PLACES
from areal.launcher.procs import ProcessSupervisor, read_failures, record_failure, root_cause
from areal.utils.recover import RecoverDir, save_state

SCRIPT = Path(__file__).parent / "entry_script.py"  # only its CONFIG is used here


@pytest.fixture
def run_launch(tmp_path, monkeypatch, tiny_model_dir):
    """``run_launch(causes, *overrides)`` -> (exit code, attempts run, RUN_DIR): ``launch`` with a
    ``run_once`` whose attempt ``i`` fails with ``causes[i]`` (None: succeeds)."""
    monkeypatch.setenv("AREAL_TEST_CONFIG", "sft")
    run_dir = tmp_path / "e" / "t"

    def run(causes: list[str | None], *overrides: str) -> tuple[int, list[int], Path]:
        attempts: list[int] = []

        def run_once(cfg, attempt: int) -> int:
            attempts.append(attempt)
            if causes[attempt] is None:
                return 0
            (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            record_failure(cfg.run_dir / "logs", "trainer", 1, causes[attempt])
            return 1

        argv = [
            f"fileroot={tmp_path}",
            "experiment_name=e",
            "trial_name=t",
            f"model.path={tiny_model_dir}",
            "cluster.n_servers=0",
            "train_dataset.type=sft",
            *overrides,
        ]
        return launch(str(SCRIPT), argv, run_once, "local", PLACES), attempts, run_dir

    yield run
    root = logging.getLogger("areal")
    for handler in [h for h in root.handlers if str(tmp_path) in getattr(h, "baseFilename", "")]:
        root.removeHandler(handler)
        handler.close()


def test_auto_recover_stops_relaunching_when_the_same_cause_repeats(run_launch, caplog):
    nan = "FloatingPointError: loss is NaN at step 3 (rank 0, pid 41234)"
    with caplog.at_level(logging.ERROR, logger="areal.launcher"):
        code, attempts, _ = run_launch(
            [nan, nan.replace("41234", "41877"), nan, None],
            "recover.mode=auto",
            "recover.retries=3",
        )
    assert code == 1 and attempts == [0, 1]  # today: relaunched three times, the same way
    assert (
        "attempt 2 failed with the same cause as attempt 1: FloatingPointError: loss is NaN"
        in caplog.text
    )
    assert "not relaunching" in caplog.text


def test_auto_recover_relaunches_while_the_cause_changes(run_launch):
    code, attempts, run_dir = run_launch(
        ["OSError: disk gone", "RuntimeError: server 1 died", None],
        "recover.mode=auto",
        "recover.retries=3",
    )
    assert code == 0 and attempts == [0, 1, 2]
    assert [r["cause"] for r in read_failures(run_dir / "logs")] == [
        "OSError: disk gone",
        "RuntimeError: server 1 died",
    ]


def test_an_unknown_cause_never_counts_as_a_repeat(run_launch):
    code, attempts, _ = run_launch(["", "", None], "recover.mode=auto", "recover.retries=2")
    assert code == 0 and attempts == [0, 1, 2]


def test_same_cause_masks_pids_ports_and_addresses_but_not_small_numbers():
    assert same_cause(
        "RuntimeError: servers are dead (127.0.0.1:43213)",
        "RuntimeError: servers are dead (127.0.0.1:51007)",
    )
    assert same_cause(
        "ValueError: bad tensor at 0x7f3a2c1d", "ValueError: bad tensor at 0x7f11aa00"
    )
    assert not same_cause("exit code 3", "exit code 1")
    assert not same_cause("RuntimeError: step 5 diverged", "RuntimeError: step 6 diverged")
    assert not same_cause("", "")


TORCHRUN_OUTPUT = """\
Traceback (most recent call last):
  File "/x/entry_script.py", line 61, in <module>
    sys.exit(main(sys.argv[1:]))
RuntimeError: entry script failed on purpose
E1123 11:37:50.123000 27360 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1)
Traceback (most recent call last):
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_11:37:50
  exitcode  : 1 (pid: 27361)
============================================================"""  # noqa: E501, W291 (torchrun's own output, verbatim)


def test_root_cause_is_the_workers_exception_not_torchruns_summary():
    lines = TORCHRUN_OUTPUT.splitlines()
    assert root_cause(lines, 1) == "RuntimeError: entry script failed on purpose"
    no_exception = [line for line in lines if not line.startswith("RuntimeError")]
    no_exception = [line.replace("exitcode  : 1", "exitcode  : 3") for line in no_exception]
    assert root_cause(no_exception, 1) == "exit code 3"  # sys.exit(3) in the worker
    assert root_cause(["starting", "killed"], -9) == "killed by SIGKILL (exit code -9)"


def test_a_rank_killed_by_a_signal_is_the_root_cause_not_a_reward_workers_broken_pipe():
    # kill -9 of the trainer rank: its reward workers print BrokenPipeError after it is gone,
    # and torchrun's summary reports the signal; the launcher named the BrokenPipeError.
    lines = [
        "[rank0]: step 3 done",
        "Traceback (most recent call last):",
        '  File "/x/multiprocessing/connection.py", line 289, in _send',
        "BrokenPipeError: [Errno 32] Broken pipe",
        *[
            line.replace("exitcode  : 1 (pid: 27361)", "exitcode  : -9 (pid: 27361)")
            for line in TORCHRUN_OUTPUT.splitlines()[5:]
        ],
        "  traceback : Signal 9 (SIGKILL) received by PID 27361",
    ]
    lines.insert(
        lines.index("  time      : 2026-11-23_11:37:50") + 1, "  rank      : 0 (local_rank: 0)"
    )
    assert root_cause(lines, 1) == "trainer rank 0 killed by SIGKILL (exit code -9)"


def test_launch_leaves_config_yaml_untouched_while_a_resume_is_pending(run_launch):
    _, _, run_dir = run_launch([None], "seed=1", "recover.mode=auto")
    original = (run_dir / "config.yaml").read_bytes()
    with RecoverDir(run_dir / "recover").writing(1) as d:
        save_state(d, 0, {"step": 1})
    # The trainer writes config.yaml once it accepts the resume; a refused one leaves it as it was.
    run_launch([None], "seed=2", "recover.mode=auto")
    assert (run_dir / "config.yaml").read_bytes() == original  # today: rewritten with seed 2
    run_launch([None], "seed=3", "recover.mode=disabled")  # no resume: a fresh run's config
    assert "\nseed: 3\n" in (run_dir / "config.yaml").read_text()


class _FullDisk:
    """A log file on a disk that fills up after ``room`` bytes."""

    def __init__(self, path: Path, room: int):
        self.file, self.room = open(path, "ab"), room

    def write(self, data: bytes) -> int:
        if self.room < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def test_log_pump_survives_enospc_and_the_excerpt_says_no_space_left_on_device(
    tmp_path, monkeypatch
):
    real_open = open
    monkeypatch.setattr(
        procs,
        "open",
        lambda path, mode="r", *a, **kw: (
            _FullDisk(path, room=2000)
            if str(path).endswith(".log")
            else real_open(path, mode, *a, **kw)
        ),
        raising=False,
    )
    # ~1 MB of output: far more than a pipe holds, so a pump that stopped draining blocks the child
    code = (
        "import sys\nfor i in range(20000): print('line', i, 'x' * 40)\nraise RuntimeError('boom')"
    )
    sup = ProcessSupervisor(tmp_path / "logs", echo=False, stop_timeout=3)
    try:
        child = sup.start("trainer", [sys.executable, "-c", code])
        child.proc.wait(timeout=60)  # today the pump thread dies on ENOSPC and this times out
        excerpt = child.tail(5)
        assert (
            "No space left on device" in excerpt and f"writing {child.log_path} failed" in excerpt
        )
        assert "RuntimeError: boom" in excerpt  # the last lines were kept in memory
        assert child.root_cause() == "RuntimeError: boom"
    finally:
        sup.stop_all()
    [failure] = read_failures(tmp_path / "logs")
    assert failure == {"process": "trainer", "code": 1, "cause": "RuntimeError: boom"}


def test_teardown_records_the_failure_that_ended_the_attempt(tmp_path):
    server = "import sys\nprint('OSError: address already in use', flush=True)\nsys.exit(1)"
    trainer = "import time\ntime.sleep(1)\nraise RuntimeError('generation servers are dead')"
    with ProcessSupervisor(tmp_path / "logs", echo=False, stop_timeout=3) as sup:
        sup.start("server0", [sys.executable, "-c", server])
        child = sup.start("trainer", [sys.executable, "-c", trainer])
        child.proc.wait(timeout=60)
        sup.start(
            "server1", [sys.executable, "-c", "import time\ntime.sleep(60)"]
        )  # killed by teardown
    [failure] = read_failures(tmp_path / "logs")
    assert failure == {
        "process": "trainer",
        "code": 1,
        "cause": "RuntimeError: generation servers are dead",
    }


def test_a_child_stopped_by_sigterm_from_outside_is_no_failure(tmp_path):
    # A batch system ending its step signals every process of it: the server that stopped on
    # that SIGTERM did not fail, and must not pass for the attempt's cause.
    import os
    import signal
    import time

    with ProcessSupervisor(tmp_path / "logs", echo=False, stop_timeout=3) as sup:
        child = sup.start("server0", [sys.executable, "-c", "import time\ntime.sleep(60)"])
        time.sleep(0.5)
        os.kill(child.proc.pid, signal.SIGTERM)
        assert child.proc.wait(timeout=30) == -signal.SIGTERM
    assert read_failures(tmp_path / "logs") == []


def test_a_child_killed_by_a_native_abort_leaves_its_python_stack_in_its_log(tmp_path):
    # SIGABRT from native code (a C++ exception escaping torch or gloo) ends a process with no
    # Python traceback of its own; the supervisor's children run with the fault handler on
    code = "import os\ndef where_it_died():\n    os.abort()\nwhere_it_died()"
    with ProcessSupervisor(tmp_path / "logs", echo=False, stop_timeout=3) as sup:
        child = sup.start("trainer", [sys.executable, "-c", code])
        assert child.proc.wait(timeout=60) == -6
    log = child.log_path.read_text()
    assert "Fatal Python error: Aborted" in log and "in where_it_died" in log, log
