"""Real daemons for tests: a one-member etcd (the name_resolve tests) and a local Ray head (the
name_resolve and Ray launcher tests), each on free loopback ports with its own data/temp dir,
started as a child in its own process group and stopped by pid. When one cannot start,
:class:`DaemonUnavailable` says precisely why (the tests skip with that reason)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from areal.utils.network import free_port
from areal.utils.process import parent_death_signal


class DaemonUnavailable(RuntimeError):
    """The daemon could not be started here; the message says why."""


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Ray workers leave the head's process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Daemon:
    """A started server: ``address`` (host:port), its log, and :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, address: str, log: Path, scratch: Path):
        self.proc, self.address, self.log, self.scratch = proc, address, log, scratch

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the daemon and every process below it; SIGKILL what is left after ``grace`` s."""
        pids = [self.proc.pid, *_descendants(self.proc.pid)]
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (
            self.proc.poll() is None or any(map(_alive, pids[1:]))
        ):
            time.sleep(0.1)
        _signal(pids, signal.SIGKILL)
        self.proc.wait(timeout=grace)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen, scratch: Path, ready, what: str, timeout: float) -> None:
    """Return once ``ready()``; else stop ``proc``, remove ``scratch`` and raise why, with the
    end of the daemon's log."""
    deadline = time.monotonic() + timeout
    while not ready():
        code = proc.poll()
        if code is not None or time.monotonic() >= deadline:
            _signal([proc.pid, *_descendants(proc.pid)], signal.SIGKILL)
            proc.wait(timeout=10)
            log = _tail(scratch / "daemon.log")
            shutil.rmtree(scratch, ignore_errors=True)
            why = (
                f"exited with code {code}"
                if code is not None
                else f"was not ready within {timeout} s"
            )
            raise DaemonUnavailable(f"{what} {why}; its log ends: {log}")
        time.sleep(0.1)


def start_etcd(timeout: float = 30.0) -> Daemon:
    """A one-member etcd (Debian's etcd-server, >= 3.4) on free loopback ports."""
    exe = shutil.which("etcd")
    if exe is None:
        raise DaemonUnavailable(
            "no etcd binary on PATH (Debian: /usr/bin/etcd from the etcd-server "
            "package; `make install` installs it when run as root)"
        )
    scratch = Path(tempfile.mkdtemp(prefix="etcd-"))
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = scratch / "daemon.log"
    cmd = [
        exe,
        "--name",
        "default",
        "--data-dir",
        str(scratch / "data"),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"default={peer}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )  # dies with pytest

    def healthy() -> bool:  # /health answers true once the member leads its one-member cluster
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    _wait_ready(proc, scratch, healthy, f"etcd ({' '.join(cmd)})", timeout)
    return Daemon(proc, client.removeprefix("http://"), log, scratch)


def start_ray_head(
    timeout: float = 90.0, num_cpus: int = 2, env: dict[str, str] | None = None
) -> Daemon:
    """A Ray head on free loopback ports with a short temp dir of its own (Ray's socket paths
    must stay under ~107 characters); ``env`` is added to its environment, which its workers
    inherit. Never stopped with `ray stop`, which stops every Ray instance of the machine."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise DaemonUnavailable(f"ray is not installed ({e}); pip install -e '.[test]'") from None
    exe = Path(sys.executable).parent / "ray"
    if not exe.exists():
        raise DaemonUnavailable(f"the ray command is missing next to {sys.executable}")
    scratch = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    gcs = free_port()
    ports = {
        f"--{name}": str(free_port())
        for name in (
            "ray-client-server-port",
            "dashboard-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "node-manager-port",
            "object-manager-port",
        )
    }
    cmd = [
        str(exe),
        "start",
        "--head",
        "--block",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        f"--port={gcs}",
        f"--temp-dir={scratch}",
        "--node-ip-address=127.0.0.1",
        "--include-dashboard=false",
        "--disable-usage-stats",
        *(f"{k}={v}" for k, v in ports.items()),
    ]
    log = scratch / "daemon.log"
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            preexec_fn=parent_death_signal(signal.SIGTERM),
        )  # ray start stops its cluster
    _wait_ready(
        proc,
        scratch,
        lambda: b"Ray runtime started" in log.read_bytes(),
        "ray start --head",
        timeout,
    )
    return Daemon(proc, f"127.0.0.1:{gcs}", log, scratch)
