"""Launcher entry script for the server-restart test: publishes weights v3 (a copy of the
actor's model) the way disk weight updates do, SIGKILLs its one server, and waits until the
launcher has it answering again on the same address with those weights' version; exit 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

from areal.api.config import GRPOConfig, load_config
from areal.utils.name_resolve import gen_servers_key, make_repository

CONFIG = GRPOConfig


def _info(addr: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://{addr}/get_model_info", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _pid_listening_on(port: int) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"serve" in cmd
            and b"--port" in cmd
            and cmd[cmd.index(b"--port") + 1] == str(port).encode()
        ):
            return int(pid)
    raise RuntimeError(f"no server process on port {port}")


def main(argv: list[str]) -> int:
    cfg = load_config(CONFIG, argv)
    registry = make_repository(cfg.cluster.name_resolve, cfg.name_resolve_root)
    # the launcher starts this script beside the server: wait for it as trainers do
    [addr] = registry.wait_subtree(gen_servers_key(cfg.experiment_name, cfg.trial_name), 1, 120)
    shutil.copytree(cfg.actor.path, cfg.weights_dir / "v3")
    os.kill(_pid_listening_on(int(addr.rsplit(":", 1)[1])), signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        info = _info(addr)
        if info is not None and info["weight_version"] == 3:
            print(f"server back on {addr} with weights version 3", flush=True)
            return 0
        time.sleep(0.2)
    print(f"server on {addr} did not come back with version 3 within 90 s", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
