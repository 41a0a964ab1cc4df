"""Tier 1: the files the ``areal core`` commands and a running async-PPO master talk through
(areal/core/status.py): a stop request is taken once, a finished or stopped run says which and
refuses requests naming the fix, and a directory that is not a run is refused."""

from __future__ import annotations

import json

import pytest

from areal.core.status import (
    STATUS_FILE,
    STOP_FILE,
    mark_finished,
    request_scale,
    request_stop,
    run_ended,
    take_stop_request,
    write_status,
)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    return tmp_path


def test_a_stop_request_is_taken_once(run_dir):
    assert not take_stop_request(run_dir)
    write_status(run_dir, 3, 10, {})
    request_stop(run_dir)
    assert (run_dir / STOP_FILE).is_file()
    assert take_stop_request(run_dir) and not take_stop_request(run_dir)
    request_stop(run_dir)  # during the last step: nobody takes it
    mark_finished(run_dir)
    assert not take_stop_request(run_dir)  # a later resume does not stop at its first step


def test_a_run_that_ended_before_its_last_step_says_it_was_stopped(run_dir):
    write_status(run_dir, 4, 10, {})
    assert run_ended(json.loads((run_dir / STATUS_FILE).read_text())) == ""  # its master: us
    mark_finished(run_dir)
    ended = run_ended(json.loads((run_dir / STATUS_FILE).read_text()))
    assert ended == "it was stopped at step 4/10 (areal core stop)"
    write_status(run_dir, 10, 10, {})
    mark_finished(run_dir)
    assert run_ended(json.loads((run_dir / STATUS_FILE).read_text())) == "it finished at step 10/10"


def test_requests_to_an_ended_run_or_a_non_run_are_refused_naming_the_fix(run_dir, tmp_path):
    write_status(run_dir, 2, 10, {})
    status = json.loads((run_dir / STATUS_FILE).read_text())
    (run_dir / STATUS_FILE).write_text(json.dumps({**status, "master_pid": 2**22 + 1}))
    with pytest.raises(ValueError, match=r"its master \(pid \d+\) is gone.*`areal core stop` "):
        request_stop(run_dir)
    with pytest.raises(ValueError, match="`areal core scale` applies to a running"):
        request_scale(run_dir, 3, [], [])
    assert not (run_dir / STOP_FILE).exists()
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        request_stop(tmp_path / "nowhere")
