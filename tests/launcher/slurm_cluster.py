"""A real two-node Slurm cluster on this machine for the Slurm launcher's tests, and runs of
``areal launch slurm``.

:func:`start_cluster` runs ``munged`` (as the munge user), ``slurmctld`` and one ``slurmd -N
<node>`` per node from Debian's packages (slurm-wlm 22.05, munge 0.5.15) in the foreground as
children of the test session, with a munge key, free ports, a slurm.conf and state, spool and log
dirs of their own under a short /tmp path (a unix socket path must stay short), and waits (with a
deadline) until ``sinfo`` shows every node idle. Both nodes are this machine (NodeAddr 127.0.0.1,
a port each), so a job of two nodes runs the multi-node path of the batch script for real.
:meth:`SlurmCluster.stop` stops them by pid. Nothing of the machine's own Slurm or munge setup is
read or changed: clients find the cluster through ``SLURM_CONF``, munge through
``AuthInfo=socket=``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal.utils.network import free_port
from areal.utils.process import parent_death_signal
from launch_harness import REPO, Launch

DAEMONS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "scancel",
    "squeue",
    "sinfo",
)
INSTALL = "apt-get install slurmctld slurmd slurm-client munge (make test does it when run as root)"


def unavailable_reason() -> str:
    """Why this machine cannot run the test cluster ('' when it can)."""
    if os.geteuid() != 0:
        return (
            "the Slurm tier needs root (munged runs as the munge user, slurmd as root); run "
            "`make test` as root"
        )
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"not installed: {', '.join(missing)}; {INSTALL}"
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        return f"there is no munge user; {INSTALL}"
    return ""


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """The daemons of one test cluster and how to reach it."""

    root: Path
    nodes: list[str]
    cpus: int  # per node
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
        )

    def jobs(self) -> list[str]:
        """`squeue` lines (id, name, state) of every job still in the queue."""
        return self.run("squeue", "-h", "-o", "%i %j %T").stdout.split("\n")[:-1]

    def wait_queue_empty(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not self.jobs(), f"jobs still in the queue after {timeout:g} s: {self.jobs()}"

    def log_tail(self, name: str, n: int = 15) -> str:
        path = self.root / "log" / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-n:])
            if path.is_file()
            else "(no log)"
        )

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons by pid (SIGTERM, then SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user=root")
        for name in (*(f"slurmd-{n}" for n in self.nodes), "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)


def _start(cluster: SlurmCluster, name: str, cmd: list[str], **kwargs) -> None:
    out = open(cluster.root / "log" / f"{name}.log", "ab")
    cluster.procs[name] = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **cluster.env},
        preexec_fn=parent_death_signal(signal.SIGTERM),  # pytest killed: stop too
        **kwargs,
    )


def _wait(cluster: SlurmCluster, what: str, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{dead[0]} exited" if dead else f"not within {timeout:g} s"
            logs = "\n".join(f"--- {n}:\n{cluster.log_tail(n)}" for n in cluster.procs)
            raise RuntimeError(f"{what}: {why}; daemon logs:\n{logs}")
        time.sleep(0.2)


def _conf(root: Path, host: str, nodes: list[str], cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=areal-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/socket",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",  # logs: stderr (-D)
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=3",  # seconds from SIGTERM to SIGKILL (the stubborn test waits it out)
            *(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={cpus} State=UNKNOWN"
                for n in nodes
            ),
            f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def start_cluster(nodes: int = 2, cpus: int = 4, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and a slurmd per node; the cluster once every node is idle.
    Raises RuntimeError naming the daemon that did not come up, with its log."""
    import pwd

    host = socket.gethostname().split(".")[0]
    names = [f"n{i + 1}" for i in range(nodes)]
    root = Path(tempfile.mkdtemp(prefix="asl", dir="/tmp"))
    root.chmod(0o755)  # munged (the munge user) must reach its socket dir
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir()
    munge = pwd.getpwnam("munge")
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    for path, mode in ((root / "munge", 0o755), (key, 0o400)):
        os.chown(path, munge.pw_uid, munge.pw_gid)
        path.chmod(mode)
    (root / "slurm.conf").write_text(_conf(root, host, names, cpus))
    cluster = SlurmCluster(root, names, cpus)
    try:
        _start(
            cluster,
            "munged",
            [
                _exe("munged"),
                "-F",
                f"--socket={root}/munge/socket",
                f"--key-file={key}",
                f"--pid-file={root}/munge/pid",
                f"--seed-file={root}/munge/seed",
                f"--log-file={root}/munge/log",
            ],
            user=munge.pw_uid,
            group=munge.pw_gid,
        )
        _wait(cluster, "munged", (root / "munge" / "socket").exists, timeout)
        conf = str(root / "slurm.conf")
        _start(cluster, "slurmctld", [_exe("slurmctld"), "-D", "-f", conf])
        for n in names:
            _start(cluster, f"slurmd-{n}", [_exe("slurmd"), "-D", "-N", n, "-f", conf])
        _wait(
            cluster,
            "every slurmd registered with slurmctld",
            lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.split() == ["idle"] * nodes,
            timeout,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_slurm_launch(
    script: str | Path,
    config: str | Path | None,
    overrides: list[str],
    fileroot: Path,
    cluster: SlurmCluster,
    env: dict[str, str] | None = None,
) -> Launch:
    """Start ``areal launch slurm SCRIPT [--config YAML] fileroot=... OVERRIDES`` in a new
    session."""
    fileroot.mkdir(parents=True, exist_ok=True)
    argv = [
        str(script),
        *(["--config", str(config)] if config else []),
        f"fileroot={fileroot}",
        "launcher.echo=false",
        "cluster.devices_per_node=0",
        *overrides,
    ]
    out_path = fileroot / "launcher.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal.cli", "launch", "slurm", *argv],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **cluster.env, **(env or {})},
            start_new_session=True,
        )
    return Launch(proc, str(fileroot), out_path)
