"""Driver for the sandbox tests as an unprivileged user (started by test_sandbox_escapes.py).

Usage: ``python sandbox_unprivileged.py UID CONFIG_JSON``. As root it imports everything, then
drops to ``UID`` (no groups); as non-root ``UID`` must be our own. It starts a process of that
uid holding 100 threads, then runs a correct solution and every escape attempt through the real
sandbox and prints one JSON object: per case the score, status, output, isolation, what the
host lost (``touched``) and the processes of ``UID`` left behind beyond the driver's own.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from areal.api.config.reward import SandboxConfig  # noqa: E402
from areal.reward.code import case_passed, code_reward  # noqa: E402
from areal.reward.sandbox import run_python, seccomp_program  # noqa: E402
from sandbox_escapes import (  # noqa: E402
    ESCAPE_CASE,
    HostTargets,
    escape_programs,
    processes_of_uid,
)

HOLDER = """
import threading, time
for _ in range(100):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
time.sleep(120)
"""
CORRECT = """```python
import threading
n = int(input())
t = threading.Thread(target=print, args=(n * n,))  # a thread of its own: counted per sandbox
t.start()
t.join()
```"""


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _start_holder() -> int:
    pid = os.fork()
    if pid == 0:
        os.execv("/usr/bin/python3", ["/usr/bin/python3", "-c", HOLDER])
    deadline = time.monotonic() + 10
    while _threads(pid) < 101:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the thread holder {pid} never reached 100 threads")
        time.sleep(0.01)
    return pid


def main() -> None:
    uid, cfg = int(sys.argv[1]), SandboxConfig(**json.loads(sys.argv[2]))
    seccomp_program()  # built while pyseccomp's files are still readable (they sit under /root)
    if os.geteuid() == 0:
        _drop_to(uid)
    elif uid != os.getuid():
        raise SystemExit(f"not root: can only run as our own uid {os.getuid()}, not {uid}")
    holder = _start_holder()
    targets = HostTargets()
    ours = processes_of_uid(uid)
    out = {"holder_threads": _threads(holder)}
    try:
        tests = [{"input": "7\n", "output": "49\n"}]
        out["correct"] = {"score": code_reward(CORRECT, tests, cfg), "left": []}
        programs = escape_programs(targets, cfg.max_processes, cfg.tmpfs_mb)
        for name, code in programs.items():
            res = run_python(code, cfg)
            out[name] = {
                "score": float(case_passed(ESCAPE_CASE, res)),
                "status": res.status,
                "stdout": res.stdout[-2000:],
                "stderr": res.stderr[-2000:],
                "isolation": res.isolation,
                "touched": targets.touched(),
                "left": sorted(processes_of_uid(uid) - ours),
            }
            targets.clean()
    finally:
        targets.close()
        os.kill(holder, 9)
        os.waitpid(holder, 0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
