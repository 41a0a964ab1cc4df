"""A submitted Slurm job seen from the login node: Slurm's commands with a deadline, the job's
state from ``scontrol``, its steps, its cancellation, what a partition has, and its logs echoed to
the console."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from areal.utils.logging import get_logger

logger = get_logger("launcher")

POLL_S = 1.0  # seconds between looks at the job's state and logs
COMMAND_TIMEOUT_S = 60.0  # one call of sbatch / scontrol / scancel / sinfo
CONTROLLER_TIMEOUT_S = 120.0  # slurmctld unreachable this long while the job runs: stop
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
    "REVOKED",
}


class JobFailed(RuntimeError):
    """The attempt failed for a reason worth recording (and, with recover.mode=auto, retrying)."""


def run_command(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm command (deadline COMMAND_TIMEOUT_S); its completed process, never raising on
    a non-zero exit."""
    try:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            cmd, 124, "", f"{cmd[0]} did not answer within {COMMAND_TIMEOUT_S:g} s"
        )


def available(partition: str) -> str:
    """What ``partition`` (empty: the default one) has, from sinfo: its nodes' CPUs, GPUs and
    states and its time limit; for a partition that does not exist, the ones that do."""
    proc = run_command(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%G|%T|%l"])
    if proc.returncode:
        return f"(sinfo failed: {proc.stderr.strip()})"
    parts: dict[str, list[list[str]]] = {}
    default = ""
    for row in (line.split("|") for line in proc.stdout.splitlines()):
        if len(row) != 6:
            continue
        if row[1].endswith("*"):
            row[1] = default = row[1][:-1]
        parts.setdefault(row[1], []).append(row)
    name = partition or default
    if name not in parts:
        there = ", ".join(sorted(parts)) or "none"
        note = f" (default {default})" if default else ""
        return f"there is no partition {name!r}; partitions here: {there}{note}"
    rows = parts[name]
    shown = "; ".join(
        f"{node}: {cpus} CPUs, {'GRES ' + gres if gres != '(null)' else 'no GPUs'}, {state}"
        for node, _, cpus, gres, state, _ in rows[:8]
    )
    more = f"; {len(rows) - 8} more" if len(rows) > 8 else ""
    return f"partition {name} has {len(rows)} node(s) ({shown}{more}), time limit {rows[0][5]}"


class SlurmJob:
    """One submitted job: its fields as ``scontrol show job`` reports them, and its cancellation."""

    def __init__(self, job_id: str):
        self.id = job_id
        self.fields: dict[str, str] = {}
        self._answered = time.monotonic()  # the controller's last answer

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "PENDING")

    @property
    def reason(self) -> str:
        return self.fields.get("Reason", "None")

    @property
    def ended(self) -> bool:
        """Out of the queue: finished and cleaned up (not COMPLETING), or forgotten by Slurm."""
        return self.state in ENDED or self.state == "GONE"

    def refresh(self) -> str:
        """Look the job up again; its state. Raises JobFailed when slurmctld has not answered
        for CONTROLLER_TIMEOUT_S."""
        proc = run_command(["scontrol", "show", "job", "-o", self.id])
        if proc.returncode == 0:
            self.fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            self._answered = time.monotonic()
        elif "Invalid job id" in proc.stderr:  # purged (MinJobAge) or never known
            self.fields = {**self.fields, "JobState": "GONE"}
        elif time.monotonic() - self._answered > CONTROLLER_TIMEOUT_S:
            raise JobFailed(
                f"slurmctld did not answer `scontrol show job` for {CONTROLLER_TIMEOUT_S:g} s: "
                f"{proc.stderr.strip()}"
            )
        return self.state

    def steps(self) -> set[str] | None:
        """Names of the job's running steps (server<i>, trainer, ...); None if squeue failed."""
        proc = run_command(["squeue", "-h", "-s", "-j", self.id, "-o", "%j"])
        return set(proc.stdout.split()) if proc.returncode == 0 else None

    def cancel(self, timeout: float) -> None:
        """``scancel`` the job and wait until it left the queue."""
        if not self.ended:
            logger.info(f"cancelling job {self.id} (scancel {self.id})")
            proc = run_command(["scancel", self.id])
            if proc.returncode:
                logger.error(f"scancel {self.id} failed: {proc.stderr.strip()}")
        self.wait_gone(timeout)

    def wait_gone(self, timeout: float) -> None:
        """Wait until the job left the queue (its processes stopped); an error naming it after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ended and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
            try:
                self.refresh()
            except JobFailed:
                break
        if not self.ended:
            logger.error(
                f"job {self.id} is still {self.state} {timeout:g} s later "
                f"(launcher.slurm.cancel_timeout); check `squeue -j {self.id}`, scancel it again, "
                "or ask an administrator about nodes stuck in COMPLETING"
            )


class LogFollower:
    """Echoes the new lines of the job's logs (RUN_DIR/logs/*.log, the launcher's own excepted)
    to the console with a ``[name]`` prefix, as the local launcher echoes its children."""

    def __init__(self, log_dir: Path, echo: bool):
        self.dir, self.echo = log_dir, echo
        self.offsets = {p: p.stat().st_size for p in self._logs()}  # earlier attempts: not again

    def _logs(self) -> list[Path]:
        return [p for p in sorted(self.dir.glob("*.log")) if p.name != "launcher.log"]

    def poll(self) -> None:
        if not self.echo:
            return
        for path in self._logs():
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            *lines, rest = data.split(
                b"\n"
            )  # a last line without its newline waits for the next poll
            self.offsets[path] = start + len(data) - len(rest)
            for line in lines:
                sys.stdout.write(f"[{path.stem}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()


def tail_lines(path: Path, n: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"
