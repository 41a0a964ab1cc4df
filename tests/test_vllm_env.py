"""Tier 1: :func:`tests.vllm_env.wait_built`, the vLLM tests' wait for the venv ``make test``
builds beside them: it waits while the pid in ``venv-vllm.building`` lives, returns at once for
a stale pid or none, and gives up at its deadline naming the pid."""

from __future__ import annotations

import subprocess

import pytest

from tests import vllm_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """vllm_env's files under a scratch cache: nothing built, nothing failed."""
    venv = tmp_path / "venv-vllm"
    for name, path in {
        "CACHE": tmp_path,
        "VENV": venv,
        "PYTHON": venv / "bin" / "python",
        "STAMP": venv / ".installed",
        "FAILED": tmp_path / "venv-vllm.failed",
        "BUILDING": tmp_path / "venv-vllm.building",
    }.items():
        monkeypatch.setattr(vllm_env, name, path)
    return tmp_path


def _detached(script: str) -> int:
    """The pid of ``sh -c script`` started as an orphan (as `make test`'s builder is to pytest:
    not our child, so reaped by someone else when it exits)."""
    out = subprocess.run(
        ["sh", "-c", f"sh -c '{script}' >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def test_waits_while_the_builder_lives_then_reports_what_it_built(cache):
    stamp = f"mkdir -p {vllm_env.VENV}; echo {vllm_env.REQUIREMENT} > {vllm_env.STAMP}"
    vllm_env.BUILDING.write_text(f"{_detached(f'sleep 1.5; {stamp}')}\n")
    # the stamp appears only after 1.5 s: an answer without waiting would be "not built"
    assert vllm_env.wait_built(deadline_s=30) == (vllm_env.PYTHON, "")


@pytest.mark.parametrize("building", [None, "garbage\n", "999999999\n"])
def test_no_builder_or_a_stale_pid_answers_at_once_with_the_status(cache, building):
    if building is not None:
        vllm_env.BUILDING.write_text(building)
    # deadline 0: a wait for a live builder would answer "did not finish" instead
    python, reason = vllm_env.wait_built(deadline_s=0)
    assert python is None and reason.startswith("the vLLM venv is not built")
    vllm_env.FAILED.write_text("pip could not reach PyPI\n")
    assert vllm_env.wait_built(deadline_s=0) == (None, "pip could not reach PyPI")


def test_gives_up_at_the_deadline_naming_the_builder(cache):
    pid = _detached("sleep 30")
    vllm_env.BUILDING.write_text(f"{pid}\n")
    try:
        python, reason = vllm_env.wait_built(deadline_s=0.5)
    finally:
        subprocess.run(["kill", str(pid)])
    assert python is None
    assert reason == f"the vLLM venv build (pid {pid}) did not finish in 0.5 s"
