"""Tier 2: Ctrl-C or SIGTERM on ``areal quickstart`` while its SFT stage trains prints one line
and exits 130, with no traceback, and every process it started is gone (issue 34, item 2).
About 20-40 s per signal on a 2-core machine (the tiny model, the trainer's start)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal.launcher.procs import descendants

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_quickstart_prints_one_line_and_no_traceback(tmp_path, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "quickstart",
            "--out",
            str(tmp_path),
            "--sft",
            "total_train_steps=500",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        start_new_session=True,
    )
    before, after, deadline, tree = b"", b"", time.monotonic() + 300, {}
    try:
        while (
            b"[trainer] steps" not in before and time.monotonic() < deadline and proc.poll() is None
        ):
            if select.select([proc.stdout], [], [], 0.5)[0]:
                before += os.read(proc.stdout.fileno(), 65536)
        assert b"[trainer] steps" in before, before.decode(errors="replace")[-3000:]
        tree = descendants(proc.pid)
        proc.send_signal(sig)
        after = proc.stdout.read()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = (before + after).decode(errors="replace")
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    said = [
        line
        for line in after.decode(errors="replace").splitlines()
        if line.strip() and "[trainer] " not in line
    ]
    assert len(said) == 1 and "interrupted" in said[0], said
    time.sleep(1)
    assert not [
        pid
        for pid in tree
        if Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    ], "a started process survived"
