"""Child-process supervision for launchers: start, prefix logs, watch, tear down.

Every child runs in its own session (process group), so teardown reaches its descendants too
(torchrun's workers, a server's helpers): SIGTERM to the group, a deadline, then SIGKILL. Each
child's output goes to ``RUN_DIR/logs/<name>.log`` and to the console with a ``[name]`` prefix.
A write to the log that fails (a full disk) does not stop the copy: the child's pipe keeps being
drained, so the child never blocks, and the closing excerpt names the error. At teardown the
child whose failure ended the attempt (the last one that exited non-zero on its own) is recorded
with its root cause (the last exception line of its output) in ``RUN_DIR/logs/failures.jsonl``,
where the relaunch loop reads it.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from areal.api.launch import launcher_env
from areal.launcher.console import Console, split_output
from areal.utils.logging import get_logger
from areal.utils.process import parent_death_signal

logger = get_logger("launcher")


FAILURES = "failures.jsonl"  # under the log dir: one record per failed launch attempt
_EXCEPTION = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::.*)?")
_TORCHRUN_EXIT = re.compile(r"\s*exitcode\s*:\s*(-?\d+)")
_TORCHRUN_RANK = re.compile(r"\s*rank\s*:\s*(\d+)")


class LogPump(threading.Thread):
    """Copies a child's output, as it comes until EOF, to its log file and the console (lines and
    progress redraws, :mod:`areal.launcher.console`; ``console`` None: no echo), and keeps the
    last lines in memory. The first failed write to the log (e.g. ENOSPC) is kept in ``error``
    and ends writing to the file, never the draining of the pipe."""

    def __init__(
        self,
        stream: io.BufferedIOBase,
        log: IO[bytes],
        prefix: str,
        console: Console | None,
        header: bytes = b"",
        keep: int = 400,
    ):
        super().__init__(daemon=True, name=f"log-pump-{prefix}")
        self.stream, self.log, self.prefix, self.console = stream, log, prefix, console
        self.header = header  # written to the log before the child's output
        self.recent: deque[str] = deque(maxlen=keep)  # the child's last lines, decoded
        self.error: OSError | None = None  # the failed write to the log, if any
        self.ended_at: float | None = None  # time.monotonic() at EOF: the child is gone

    def run(self) -> None:
        self._write(self.header)
        pending = b""
        # read1: whatever the pipe holds now, so a progress frame (no newline) shows at once
        for chunk in iter(lambda: self.stream.read1(65536), b""):
            self._write(chunk)
            items, pending = split_output(pending + chunk)
            for kind, raw in items:
                text = raw.decode(errors="replace")
                if kind == "line":
                    self.recent.append(text)
                if self.console is not None:
                    (self.console.line if kind == "line" else self.console.redraw)(
                        self.prefix, text
                    )
        if pending.strip(b"\r"):  # the last line had no newline
            text = pending.rsplit(b"\r", 1)[-1].decode(errors="replace")
            self.recent.append(text)
            if self.console is not None:
                self.console.line(self.prefix, text)
        self.ended_at = time.monotonic()
        self._write(None)

    def _write(self, line: bytes | None) -> None:
        """Append ``line`` to the log (None: close it) unless a write already failed."""
        if self.error is not None:
            return
        try:
            if line is None:
                self.log.close()
            else:
                self.log.write(line)
                self.log.flush()
        except OSError as e:
            self.error = e
            try:
                self.log.close()
            except OSError:
                pass  # the buffered bytes it could not write either: the same error, kept above


@dataclass
class Child:
    """One supervised process."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    _pump: LogPump | None = field(default=None, repr=False)

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines this process printed (for error messages; never lines an earlier
        process left in the same log file); when writing the log failed, also the error."""
        if self._pump is not None:
            self._pump.join(timeout=2)
            lines = list(self._pump.recent)[-n:]
            if self._pump.error is None:
                return "\n".join(lines)
            note = (
                f"(writing {self.log_path} failed: {self._pump.error}; these last lines were kept "
                "in memory and the rest of the output is lost; free space on that disk)"
            )
            return "\n".join([*lines, note])
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def root_cause(self) -> str:
        """The line that says why the child failed (see :func:`root_cause`)."""
        lines = list(self._pump.recent) if self._pump is not None else []
        return root_cause(lines, self.proc.returncode)


def root_cause(lines: list[str], code: int | None) -> str:
    """Why a process failed. A process killed by a signal (``code`` < 0), or a trainer rank whose
    death by a signal torchrun's summary reports, was killed: that is the cause, and errors
    printed after it by other processes (a reward worker's ``BrokenPipeError`` once the rank is
    gone) are its consequences. Else the last exception line of the output (``RuntimeError:
    ...``), torchrun's own ``ChildFailedError`` skipped; else the exit code torchrun reports for
    the first failed worker; else ``exit code <code>``."""
    killed = _killed_by_signal(lines, code)
    if killed:
        return killed
    for line in reversed(lines):
        text = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        m = _EXCEPTION.fullmatch(text)
        if m and not m.group(1).endswith("ChildFailedError"):
            return text
    for line in lines:
        if m := _TORCHRUN_EXIT.match(line):
            return f"exit code {m.group(1)}"
    return f"exit code {code}"


def _killed_by_signal(lines: list[str], code: int | None) -> str:
    """``killed by SIGKILL (exit code -9)`` for a process killed by a signal, ``trainer rank 0
    killed by SIGKILL (...)`` for the first failed worker of torchrun's summary; else ''."""
    if code is not None and code < 0:
        return f"killed by {_signal_name(-code)} (exit code {code})"
    for i, line in enumerate(lines):
        if (m := _TORCHRUN_EXIT.match(line)) and int(m.group(1)) < 0:
            ranks = (
                r.group(1)
                for earlier in reversed(lines[:i])
                if (r := _TORCHRUN_RANK.match(earlier))
            )
            rank = next(ranks, "?")
            signal_name = _signal_name(-int(m.group(1)))
            return f"trainer rank {rank} killed by {signal_name} (exit code {m.group(1)})"
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def record_failure(log_dir: str | Path, process: str, code: int, cause: str) -> None:
    """Append why a launch attempt failed to ``log_dir/failures.jsonl`` (read by the relaunch
    loop of :func:`areal.launcher.common.launch`)."""
    with open(Path(log_dir) / FAILURES, "a") as f:
        f.write(json.dumps({"process": process, "code": code, "cause": cause}) + "\n")


def read_failures(log_dir: str | Path) -> list[dict]:
    """Every record :func:`record_failure` appended under ``log_dir`` (oldest first)."""
    path = Path(log_dir) / FAILURES
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def http_ok(child: Child, url: str, deadline: float, timeout: float) -> bool:
    """Whether ``url`` answers 200 now; raises naming ``child`` if it died first, or if the
    ``deadline`` (``time.monotonic()``; ``timeout`` seconds after the start, for the message)
    passed."""
    if child.proc.poll() is not None:
        raise RuntimeError(
            f"{child.name} exited with code {child.proc.returncode} before {url} answered; "
            f"last lines of {child.log_path}:\n{child.tail()}"
        )
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return True
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        pass
    if time.monotonic() >= deadline:
        raise TimeoutError(
            f"{child.name} did not answer {url} within {timeout:.0f}s (raise launcher."
            f"server_setup_timeout if the model is large); last lines:\n{child.tail()}"
        )
    return False


class ProcessSupervisor:
    """Starts children, watches them, and stops all of them (used as a context manager)."""

    def __init__(self, log_dir: str | Path, echo: bool = True, stop_timeout: float = 20.0):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.console = (
            Console() if echo else None
        )  # one for all children: their echoes never interleave
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None
    ) -> Child:
        """Start ``cmd`` (in ``cwd``) in a new session; output to RUN_DIR/logs/<name>.log and the
        console."""
        log_path = self.log_dir / f"{name}.log"
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            # PYTHONFAULTHANDLER: a child killed by a native crash (SIGSEGV, SIGABRT: a C++
            # exception in torch or gloo) writes every thread's Python stack to its log
            env={"PYTHONFAULTHANDLER": "1", **os.environ, **launcher_env(), **(env or {})},
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),  # dies with us, even on SIGKILL
        )
        log = open(log_path, "ab")
        assert isinstance(proc.stdout, io.BufferedReader)  # stdout=PIPE, binary: Popen's own
        pump = LogPump(proc.stdout, log, name, self.console, header=f"$ {' '.join(cmd)}\n".encode())
        pump.start()
        child = Child(name, proc, log_path, pump)
        self.children.append(child)
        logger.info(f"started {name} (pid {proc.pid}); log {log_path}")
        return child

    def wait_http_ok(self, child: Child, url: str, timeout: float) -> None:
        """Poll ``url`` until it answers 200; raise naming the child if it dies or time runs out."""
        deadline = time.monotonic() + timeout
        while not http_ok(child, url, deadline, timeout):
            time.sleep(0.2)

    def stop_all(self) -> None:
        """SIGTERM every child's process group and every descendant (torchrun starts its
        workers in sessions of their own), wait up to stop_timeout, then SIGKILL what is left."""
        self._record_failure()
        self._mute_console()
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

    def _mute_console(self) -> None:
        """Echo nothing more: what the children print while they are stopped is shutdown noise
        (torchrun's SignalException traceback after Ctrl-C, vLLM's ``nanobind: leaked`` report
        at exit, uvicorn's shutdown lines), kept in their logs only. The output of children that
        already ended (a trainer's last lines, its error) is echoed in full first."""
        if self.console is None:
            return
        for child in self.children:
            if child.proc.poll() is not None and child._pump is not None:
                child._pump.join(timeout=2)
        self.console.broken = True

    def _record_failure(self) -> None:
        """Record the child whose failure ended the attempt: of those that exited non-zero on
        their own (before this teardown), the last one. One stopped by SIGTERM or SIGINT was asked
        to stop (a batch system ending its step, a user): that is no failure of its own."""
        asked = (None, 0, -signal.SIGTERM, -signal.SIGINT)
        failed = [c for c in self.children if c.proc.poll() not in asked]
        if not failed:
            return
        for child in failed:
            if child._pump is not None:
                child._pump.join(timeout=2)  # its last lines: the cause is usually the last one
        last = max(failed, key=_exit_seen_at)
        try:
            record_failure(self.log_dir, last.name, last.proc.returncode, last.root_cause())
        except OSError as e:  # a full disk: the relaunch loop then sees no cause and relaunches
            logger.error(
                f"could not record why {last.name} failed in {self.log_dir / FAILURES}: {e}"
            )

    def _descendants(self) -> dict[int, int]:
        tree: dict[int, int] = {}
        for child in self.children:
            tree.update(descendants(child.proc.pid))
        return tree

    def __enter__(self) -> ProcessSupervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def _exit_seen_at(child: Child) -> float:
    """When the child's output ended (about when it exited); unknown ones sort first."""
    ended = child._pump.ended_at if child._pump is not None else None
    return ended if ended is not None else float("-inf")


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
    stats = {
        pid: st
        for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if (st := _proc_stat(pid)) is not None
    }
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
    return [
        pid for pid, start in tree.items() if (st := _proc_stat(pid)) is not None and st[1] == start
    ]


def _signal_pids(tree: dict[int, int], sig: signal.Signals) -> None:
    for pid in _live(tree):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
