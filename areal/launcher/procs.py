"""Child-process supervision for launchers: start, prefix logs, watch, tear down.

Every child runs in its own session (process group), so teardown reaches its descendants too
(torchrun's workers, a server's helpers): SIGTERM to the group, a deadline, then SIGKILL. Each
child's output goes to ``RUN_DIR/logs/<name>.log`` and to the console with a ``[name]`` prefix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from areal.utils.logging import get_logger

logger = get_logger("launcher")


@dataclass
class Child:
    """One supervised process."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    _pump: threading.Thread | None = field(default=None, repr=False)

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the child's log (for error messages)."""
        if self._pump is not None:
            self._pump.join(timeout=2)
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"


def _pump(stream: IO[bytes], log: IO[bytes], prefix: str, echo: bool) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(f"[{prefix}] {line.decode(errors='replace')}")
            sys.stdout.flush()
    log.close()


class ProcessSupervisor:
    """Starts children, watches them, and stops all of them (used as a context manager)."""

    def __init__(self, log_dir: str | Path, echo: bool = True, stop_timeout: float = 20.0):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        """Start ``cmd`` in a new session; output to RUN_DIR/logs/<name>.log and the console."""
        log_path = self.log_dir / f"{name}.log"
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log = open(log_path, "ab")
        log.write(f"$ {' '.join(cmd)}\n".encode())
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, name, self.echo), daemon=True)
        pump.start()
        child = Child(name, proc, log_path, pump)
        self.children.append(child)
        logger.info(f"started {name} (pid {proc.pid}); log {log_path}")
        return child

    def wait_http_ok(self, child: Child, url: str, timeout: float) -> None:
        """Poll ``url`` until it answers 200; raise naming the child if it dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.proc.returncode} before {url} answered; "
                    f"last lines of {child.log_path}:\n{child.tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(
            f"{child.name} did not answer {url} within {timeout:.0f}s (raise launcher."
            f"server_setup_timeout if the model is large); last lines:\n{child.tail()}"
        )

    def stop_all(self) -> None:
        """SIGTERM every child's process group and every descendant (torchrun starts its
        workers in sessions of their own), wait up to stop_timeout, then SIGKILL what is left."""
        tree = self._descendants()  # taken first: once torchrun dies its workers are orphans
        for child in self.children:
            _signal_group(child.proc, signal.SIGTERM)
        _signal_pids(tree, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{child.name} ignored SIGTERM for {self.stop_timeout}s; killing it")
        tree.update(self._descendants())
        while _live(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)  # also reaps leftover descendants
        _signal_pids(tree, signal.SIGKILL)
        for child in self.children:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error(f"{child.name} (pid {child.proc.pid}) did not die after SIGKILL")
            if child._pump is not None:
                child._pump.join(timeout=2)
        self.children.clear()

    def _descendants(self) -> dict[int, int]:
        tree: dict[int, int] = {}
        for child in self.children:
            tree.update(descendants(child.proc.pid))
        return tree

    def __enter__(self) -> ProcessSupervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie ``pid``; None otherwise."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[19]))


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root`` (from /proc; empty without it)."""
    if not os.path.isdir("/proc"):
        return {}
    stats = {pid: st for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
             if (st := _proc_stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = stats[pid][1]
        todo += children.get(pid, [])
    return found


def _live(tree: dict[int, int]) -> list[int]:
    """The pids of ``tree`` that still run (same start time, so a reused pid does not count)."""
    return [pid for pid, start in tree.items() if (st := _proc_stat(pid)) is not None and st[1] == start]


def _signal_pids(tree: dict[int, int], sig: signal.Signals) -> None:
    for pid in _live(tree):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
