"""Tier 2: progress is visible while `make demo`'s SFT stage runs (issue 34, item 1).

The demo's SFT stage (``examples/sft.py`` + ``examples/sft_arithmetic.yaml`` through ``areal
launch local``, shortened to 8 steps of 8 problems) runs twice, and the test reads the launcher's
echoed output as it comes:

- on a terminal (a pty, as `make demo` in a shell): tqdm's ``\\r`` redraws reach the console
  while the stage runs, and the step count advances frame by frame;
- piped (a CI log): plain ``steps k/N (..%) | .. steps/s | ETA ..`` lines, several before the end.

About 40-60 s on a 2-core machine (two launches of ~20-30 s each, mostly the trainer's start).
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
pytestmark = pytest.mark.slow


def _command(model: str, fileroot: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal.cli",
        "launch",
        "local",
        str(REPO / "examples" / "sft.py"),
        "--config",
        str(REPO / "examples" / "sft_arithmetic.yaml"),
        f"model.path={model}",
        f"fileroot={fileroot}",
        f"total_train_steps={STEPS}",
        "train_dataset.batch_size=8",
        "valid_dataset=null",
    ]


def _read_until_exit(proc: subprocess.Popen, fd: int, timeout: float) -> list[tuple[float, str]]:
    """(seconds since start, text) of every read from ``fd`` until the process ends."""
    chunks, start = [], time.monotonic()
    try:
        while time.monotonic() - start < timeout:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # a pty's reader gets EIO once the writer side is gone
                    data = b""
                if not data:
                    break
                chunks.append((time.monotonic() - start, data.decode(errors="replace")))
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    return chunks


def test_terminal_sees_the_sft_stage_step_count_advance_while_it_runs(tiny_model_dir, tmp_path):
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        _command(tiny_model_dir, tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        cwd=REPO,
        start_new_session=True,
    )
    os.close(secondary)
    chunks = _read_until_exit(proc, primary, timeout=300)
    os.close(primary)
    assert proc.returncode == 0, "".join(text for _, text in chunks)[-3000:]
    text, frame = (
        "".join(t for _, t in chunks),
        rf"\[trainer\] steps:\s+\d+%\S*\s*\S*\s*(\d+)/{STEPS}",
    )
    seen = sorted({int(m.group(1)) for m in re.finditer(frame, text)})
    assert len(seen) >= 3 and seen[-1] == STEPS, text[-3000:]
    first_frame_at = min(t for t, chunk in chunks if re.search(frame, chunk))
    assert (
        first_frame_at < chunks[-1][0] - 1.0
    )  # frames arrived while the stage ran, not at its end


def test_a_log_gets_plain_progress_lines_while_the_sft_stage_runs(tiny_model_dir, tmp_path):
    proc = subprocess.Popen(
        _command(tiny_model_dir, tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    chunks = _read_until_exit(proc, proc.stdout.fileno(), timeout=300)
    text = "".join(t for _, t in chunks)
    assert proc.returncode == 0, text[-3000:]
    lines = re.findall(
        rf"^\[trainer\] steps (\d+)/{STEPS} \(\d+%\) \| [\d.]+ steps/s \| ETA \S+ "
        rf"\| loss [-\d.e]+$",
        text,
        re.M,
    )
    assert [int(s) for s in lines][:3] == [1, 2, 3] and int(lines[-1]) == STEPS, text[-3000:]
    assert "\r" not in text  # no redraws in a log
    assert re.search(rf"^\[trainer\] done: {STEPS} steps in \S+ \| loss ", text, re.M), text[-3000:]
