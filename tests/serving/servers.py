"""Test helper: ``areal serve`` as real processes on free loopback ports, with a start-up
deadline and teardown that always reaps them. Output goes to a temp file whose tail is shown
when a server dies or never becomes healthy."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from areal.utils.network import free_port

STARTUP_DEADLINE_S = 90.0


def _healthy(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.is_file() else "(no output)"


def start_servers(
    model_dir: str, n: int = 1, *extra: str, open_files: int | None = None
) -> list[tuple[subprocess.Popen, str]]:
    """Start ``n`` servers at once (extra CLI args for each; ``open_files``: their soft and hard
    open-file limit); return ``(process, host:port)`` once every one answers /health, or stop
    them all and raise with the server's output."""
    log_dir = Path(tempfile.mkdtemp(prefix="areal-serve-"))
    procs = []
    for i in range(n):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "areal.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(port),
            *extra,
        ]
        with open(log_dir / f"server{i}.log", "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                preexec_fn=None
                if open_files is None
                else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files)),
            )
        proc.log_dir = log_dir  # removed by stop_servers
        procs.append((proc, f"127.0.0.1:{port}"))
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    for i, (proc, addr) in enumerate(procs):
        while not _healthy(addr):
            log = log_dir / f"server{i}.log"
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_servers(procs)
                state = (
                    f"exited with {proc.returncode}"
                    if proc.poll() is not None
                    else f"not healthy within {STARTUP_DEADLINE_S} s"
                )
                raise RuntimeError(f"server {addr} {state}; output:\n{_tail(log)}")
            time.sleep(0.2)
    return procs


def stop_servers(procs: list[tuple[subprocess.Popen, str]]) -> None:
    """SIGTERM every server still running, wait, then SIGKILL what is left; remove their logs."""
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for log_dir in {getattr(proc, "log_dir", None) for proc, _ in procs} - {None}:
        shutil.rmtree(log_dir, ignore_errors=True)
