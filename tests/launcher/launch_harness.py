"""Test harness for runs through the real local launcher (``areal launch local``).

:class:`Launch` starts the launcher in its own session, records every descendant it ever sees
(pid + start time + command line, by walking /proc), and can assert that none of them is left
after teardown. Children of the launcher run in their own sessions, so killing the launcher's
group alone would not reach them: :meth:`Launch.cleanup` kills every recorded descendant's group
and every process whose command line mentions the run's marker (its fileroot).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.daemons import Daemon

REPO = Path(__file__).resolve().parents[2]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on ``host:port``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def alive(pid: int, start: int) -> bool:
    """True if the process ``pid`` that started at ``start`` still exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[2] == start and st[0] not in ("Z", "X")


def marked_processes(marker: str) -> dict[int, str]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None and st[0] not in ("Z", "X") and pid != os.getpid():
            cmd = _cmdline(pid)
            if marker in cmd:
                found[pid] = cmd
    return found


@dataclass
class Launch:
    """One ``areal launch local`` process and every descendant seen while it ran."""

    proc: subprocess.Popen
    marker: str  # a string in every run process's command line (the test's fileroot)
    out_path: Path
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (start, cmdline)
    # the root pid of a Ray cluster the run joins (RAY_ADDRESS): its processes started since the
    # launch (the run's actors: the cluster runs one run at a time) are the run's too
    cluster: int | None = None
    in_cluster: set[int] = field(default_factory=set)
    since: int = 0  # the launcher's start time (clock ticks)

    def snapshot(self) -> None:
        """Record the launcher's current descendants, and the cluster's processes started since
        the launch."""
        children: dict[int, list[int]] = {}
        for pid in _all_pids():
            st = _stat(pid)
            if st is not None:
                children.setdefault(st[1], []).append(pid)
        self._record(children, self.proc.pid)
        if self.cluster is not None:
            self.in_cluster.update(self._record(children, self.cluster, self.since))

    def _record(self, children: dict[int, list[int]], root: int, since: int = 0) -> list[int]:
        """Record the descendants of ``root`` started at or after ``since``; their pids."""
        todo, recorded = list(children.get(root, [])), []
        while todo:
            pid = todo.pop()
            st = _stat(pid)
            # a first sighting can fall between fork and exec (the parent's command line), so a
            # live process's command line is read again each time; a reused pid keeps the first
            if (
                st is not None
                and st[2] >= since
                and (pid not in self.seen or self.seen[pid][0] == st[2])
            ):
                cmd = _cmdline(pid)
                self.seen[pid] = (st[2], cmd or self.seen.get(pid, (0, ""))[1])
                recorded.append(pid)
            todo += children.get(pid, [])
        return recorded

    def wait(self, timeout: float, until=None) -> int | None:
        """Poll until the launcher exits (its code) or ``until()`` is true (None), recording
        descendants; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.snapshot()
            code = self.proc.poll()
            if code is not None:
                return code
            if until is not None and until():
                return None
            time.sleep(0.1)
        raise AssertionError(
            f"launcher still running after {timeout:.0f} s; output:\n{self.output()}"
        )

    def output(self, n: int = 60) -> str:
        """The last ``n`` lines of the launcher's console output."""
        return "\n".join(self.out_path.read_text(errors="replace").splitlines()[-n:])

    def survivors(self) -> dict[int, str]:
        """Recorded descendants still alive, plus any live process mentioning the marker."""
        left = {pid: cmd for pid, (start, cmd) in self.seen.items() if alive(pid, start)}
        return {**left, **marked_processes(self.marker)}

    def assert_no_survivors(self, timeout: float = 15.0) -> None:
        """Every process of the run is gone within ``timeout`` seconds."""
        assert self.cluster is None or self.in_cluster, "no process of the run seen on its cluster"
        deadline = time.monotonic() + timeout
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.survivors()
        assert not left, f"processes of the run outlived the launcher: {left}"

    def cleanup(self) -> None:
        """SIGKILL the launcher and everything of the run (finalizer; safe to call twice)."""
        for pid in [self.proc.pid, *self.seen]:
            try:
                if pid in self.in_cluster:  # its group may be the cluster's
                    if alive(pid, self.seen[pid][0]):
                        os.kill(pid, signal.SIGKILL)
                elif pid == self.proc.pid or alive(pid, self.seen[pid][0]):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in marked_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_launch(
    script: str | Path,
    config: str | Path | None,
    overrides: list[str],
    fileroot: Path,
    env: dict[str, str] | None = None,
    mode: str = "local",
    cluster: Daemon | None = None,
) -> Launch:
    """Start ``areal launch MODE SCRIPT [--config YAML] fileroot=... OVERRIDES`` in a new
    session; ``cluster``: a Ray head (:class:`tests.daemons.Daemon`) the run joins through
    RAY_ADDRESS, whose processes started from now on are the run's too (:class:`Launch`)."""
    fileroot.mkdir(parents=True, exist_ok=True)
    argv = [
        str(script),
        *(["--config", str(config)] if config else []),
        f"fileroot={fileroot}",
        "launcher.echo=false",
        *overrides,
    ]
    out_path = fileroot / "launcher.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal.cli", "launch", mode, *argv],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={
                **os.environ,
                "TOKENIZERS_PARALLELISM": "false",
                **(env or {}),
                **({"RAY_ADDRESS": cluster.address} if cluster is not None else {}),
            },
            start_new_session=True,
        )
    st = _stat(proc.pid)
    assert st is not None  # not reaped yet (a zombie at worst): its /proc entry is there
    root = cluster.proc.pid if cluster is not None else None
    return Launch(proc, str(fileroot), out_path, cluster=root, since=st[2])


def server_ports(run_dir: Path) -> list[int]:
    """Ports of the servers the launcher started (from each server log's command line)."""
    ports = []
    for log in sorted((run_dir / "logs").glob("server*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"\$ .* --port (\d+)", line)
            if m:
                ports.append(int(m.group(1)))
    return ports


def assert_ports_free(ports: list[int], timeout: float = 10.0) -> None:
    """Every port can be bound again within ``timeout`` seconds."""
    assert ports, "no server ports were recorded"
    deadline = time.monotonic() + timeout
    while not all(port_is_free(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.1)
    busy = [p for p in ports if not port_is_free(p)]
    assert not busy, f"server ports still bound after teardown: {busy}"


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file (empty list if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def effective_ids(run_dir: Path) -> dict[int, list[str]]:
    """step -> ids of the last record per step in trained_samples-rank0.jsonl (what counted)."""
    return {r["step"]: r["ids"] for r in read_jsonl(run_dir / "trained_samples-rank0.jsonl")}


def train_steps(run_dir: Path) -> dict[int, dict]:
    """step -> the last stats.jsonl record of that step."""
    return {r["step"]: r for r in read_jsonl(run_dir / "stats.jsonl")}


def assert_finite(record: dict, keys: list[str]) -> None:
    """Every key is present in ``record`` and finite."""
    missing = [k for k in keys if k not in record]
    assert not missing, (
        f"metrics missing from step {record.get('step')}: {missing}; has {sorted(record)}"
    )
    bad = {k: record[k] for k in keys if not math.isfinite(record[k])}
    assert not bad, f"non-finite metrics at step {record.get('step')}: {bad}"
