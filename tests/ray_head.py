"""A real local Ray cluster for tests: ``ray start --head --block`` as a child process on a free
loopback port with its own short temp dir, stopped by its process group (never a bare
``ray stop``, which would stop every Ray process on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal.utils.network import free_port

START_DEADLINE_S = 90.0


class RayHead:
    """One head node; ``address`` is what ``ray.init(address=...)`` and ``launcher.ray.address``
    take. ``skip_reason`` is set instead when Ray is missing or cannot start here."""

    def __init__(self, num_cpus: int = 6):
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.skip_reason = ""
        ray_bin = Path(sys.executable).with_name("ray")
        if not ray_bin.exists():
            self.skip_reason = f"Ray is not installed in this venv ({ray_bin} missing): pip install -e '.[ray]'"
            return
        self.temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's sockets live there
        port = free_port()
        self.log = self.temp / "head.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(ray_bin), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
                 "--num-gpus=0", f"--temp-dir={self.temp / 't'}", "--include-dashboard=false",
                 "--node-ip-address=127.0.0.1", "--disable-usage-stats"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
            )
        self.address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + START_DEADLINE_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-1500:]
                self.stop()
                self.skip_reason = f"the Ray head did not start within {START_DEADLINE_S:g} s: {tail}"
                return
            time.sleep(0.5)

    def _ready(self) -> bool:
        out = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{self.address}'); "
                              "print(ray.cluster_resources().get('CPU', 0))"],
                             capture_output=True, text=True, timeout=60)
        return out.returncode == 0 and float(out.stdout.strip().splitlines()[-1] or 0) > 0

    def processes(self) -> list[int]:
        """Live pids whose command line names this head's temp dir (the whole cluster)."""
        marker = str(self.temp).encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    def stop(self) -> None:
        """SIGTERM the head's process group, then SIGKILL it and every process of the cluster."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)
