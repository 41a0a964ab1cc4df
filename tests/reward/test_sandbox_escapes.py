"""The escape suite (issue #17): each attempt scores 0 and leaves nothing behind, as root and as
an unprivileged user whose other processes hold 100 threads; correct code still scores 1 there.

The programs are in ``sandbox_escapes.py``; the unprivileged run is one ``sandbox_unprivileged.py``
process (it drops to a fresh uid when we are root, else runs as us).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from areal.api.config.reward import SandboxConfig
from areal.reward.code import case_passed
from areal.reward.sandbox import run_python
from sandbox_escapes import (
    ESCAPE_CASE,
    ESCAPE_NAMES,
    UNREPORTED,
    HostTargets,
    escape_programs,
    processes_of_uid,
)

CFG = SandboxConfig(case_timeout=1.5, submission_timeout=10.0, cpu_seconds=2, tmpfs_mb=16)
DRIVER = Path(__file__).with_name("sandbox_unprivileged.py")
ROOT_ONLY = "runs the sandbox as root (a fresh uid per case); this test process is not root"


def _check_held(name: str, outcome: dict) -> None:
    """A held escape: score 0, the program saw its attempts refused, nothing on the host changed,
    no process left."""
    assert outcome["score"] == 0.0, outcome
    assert outcome["touched"] == [], outcome
    assert outcome["left"] == [], outcome
    lines = outcome["stdout"].strip().splitlines()
    if name in UNREPORTED:
        assert outcome["status"] in UNREPORTED[name] and "ESCAPED" not in lines, outcome
    else:  # it ran to the end and reported every attempt refused
        assert lines and lines[-1] == "held", outcome
    assert outcome["isolation"].startswith("userns+mntns+pidns+netns+ipcns+seccomp"), outcome


@pytest.fixture(scope="module")
def root_targets():
    if os.geteuid() != 0:
        pytest.skip(ROOT_ONLY)
    targets = HostTargets()
    yield targets
    targets.close()


@pytest.mark.parametrize("name", ESCAPE_NAMES)
def test_escape_as_root_scores_zero_and_leaves_nothing(name, root_targets):
    code = escape_programs(root_targets, CFG.max_processes, CFG.tmpfs_mb)[name]
    res = run_python(code, CFG)
    outcome = {
        "score": float(case_passed(ESCAPE_CASE, res)), "status": res.status, "stdout": res.stdout,
        "isolation": res.isolation, "touched": root_targets.touched(),
        "left": sorted(processes_of_uid(res.uid)),
    }  # fmt: skip
    root_targets.clean()
    assert res.uid >= 200_000  # ran as a fresh uid, not as root
    _check_held(name, outcome)


def _unused_uid() -> int:
    while True:
        uid = random.randrange(100_000, 200_000)
        if not processes_of_uid(uid):
            return uid


@pytest.fixture(scope="module")
def unprivileged_run() -> dict:
    """One driver process: a fresh uid when we are root, else our own uid."""
    uid = _unused_uid() if os.geteuid() == 0 else os.getuid()
    cfg = json.dumps(dataclasses.asdict(CFG))
    run = subprocess.run([sys.executable, str(DRIVER), str(uid), cfg], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, f"driver failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ESCAPE_NAMES)
def test_escape_as_unprivileged_user_scores_zero_and_leaves_nothing(name, unprivileged_run):
    _check_held(name, unprivileged_run[name])


def test_correct_code_scores_one_as_unprivileged_user_holding_100_threads(unprivileged_run):
    # RLIMIT_NPROC is 16 + 2 inside the sandbox's user namespace; the user's 101 tasks outside
    # do not count against it.
    assert unprivileged_run["holder_threads"] >= 101
    assert unprivileged_run["correct"]["score"] == 1.0
