"""Escape attempts against the code sandbox, shared by the root tests and the unprivileged driver.

Every program ends by printing ``ESCAPED`` when any of its attempts worked and ``held``
otherwise; ``ESCAPE_CASE`` expects ``ESCAPED``, so a sandbox that holds scores 0 on each. Some
are stopped before they can print (``UNREPORTED``: bombs by the deadline or a MemoryError, a
foreign-ABI syscall by SIGSYS). :class:`HostTargets` sets up what the programs aim at on the host
(marker paths, a process with a secret on its command line, listeners) and reports afterwards
what was touched.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import uuid
from pathlib import Path

ESCAPE_CASE = {"input": "", "output": "ESCAPED"}
# Programs stopped before they can report, and the statuses they may end with.
UNREPORTED = {"fork_bomb": ("timeout",), "memory_bomb": ("memory",),
              "i386_syscall": ("runtime_error",)}  # fmt: skip

_END = "\nprint('ESCAPED' if escaped else 'held')\n"

_PROGRAMS = {
    "fork_exec": """
import subprocess
escaped = False
try:  # subprocess -> _posixsubprocess.fork_exec -> execve
    run = subprocess.run(["/bin/sh", "-c", "touch /tmp/{token}_sh; echo ran"], capture_output=True)
    escaped = b"ran" in run.stdout
except OSError as e:
    print("refused:", e)
""",
    "posix_spawn": """
import os
escaped = False
try:
    pid = os.posix_spawn("/bin/sh", ["sh", "-c", "touch /tmp/{token}_spawn"], {{}})
    escaped = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
except OSError as e:
    print("refused:", e)
""",
    "ctypes_exec": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
argv = (ctypes.c_char_p * 4)(b"/bin/sh", b"-c", b"echo ESCAPED", None)
libc.execve(b"/bin/sh", argv, None)  # on success the shell prints ESCAPED and exits
libc.syscall(59, b"/bin/sh", argv, None)  # raw execve on x86-64
libc.syscall(322, -100, b"/bin/sh", argv, None, 0)  # raw execveat
escaped = False
""",
    "mkfifo_mknod": """
import os
escaped = False
for attempt in (lambda: os.mkfifo("/tmp/{token}_fifo"), lambda: os.mkfifo("fifo_here"),
                lambda: os.mknod("/dev/shm/{token}_node")):
    try:
        attempt()
        escaped = True
    except OSError as e:
        print("refused:", e)
""",
    "proc_read": """
import os
escaped = False
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{{pid}}/{{name}}", "rb") as f:
                escaped |= b"{secret}" in f.read()
        except OSError:
            pass
""",
    "disk_bomb": """
import os
escaped = False
chunk = b"x" * (1 << 20)
for where in ("/tmp", "/dev/shm", "."):
    written = 0  # MiB; stops a little past the cap so a broken sandbox cannot fill the host
    while written < {cap_mb} + 8:
        try:
            with open(f"{{where}}/{token}_{{written}}", "wb") as f:
                f.write(chunk)
            written += 1
        except OSError:
            break
    print(where, written, "MiB")
    escaped |= written > {cap_mb} + 1
""",
    "tcp_loopback": """
import socket
escaped = False
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"leak")
    escaped = True
except OSError as e:
    print("refused:", e)
""",
    "unix_sockets": """
import socket
escaped = False
for address in ("{unix_path}", "\\0{abstract}"):
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
        escaped = True
    except OSError as e:
        print("refused:", e)
""",
    "fork_bomb": """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
    "thread_bomb": """
import threading, time, os
n = 0  # RLIMIT_AS usually stops threads first (each reserves stack and a malloc arena)
try:
    while n < 200:
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("refused:", e)
escaped = n > {max_processes}
print('ESCAPED' if escaped else 'held', flush=True)
os._exit(0)
""",
    "process_bomb": """
import os, time
n = 0  # processes started; stops at 200 so a broken sandbox cannot flood the host
try:
    while n < 200:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError as e:
    print("refused:", e)
escaped = n > {max_processes}
print('ESCAPED' if escaped else 'held', flush=True)
os._exit(0)
""",
    "i386_syscall": """
import ctypes, mmap
# i386 execve(NULL, NULL, NULL) through int 0x80: a filter that only checked x86-64 numbers would
# let it reach the kernel (-14, EFAULT); the arch check must kill the process (SIGSYS) instead.
code = bytes([0xb8, 0x0b, 0, 0, 0, 0x31, 0xdb, 0x31, 0xc9, 0x31, 0xd2, 0xcd, 0x80, 0xc3])
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
escaped = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))() == -14
""",
    "memory_bomb": """
x = bytearray(10 * 1024**3)
escaped = True
""",
    "signals": """
import os, signal
escaped = False
try:
    os.kill({victim}, signal.SIGKILL)
    escaped = True
except OSError as e:
    print("refused:", e)
print('ESCAPED' if escaped else 'held', flush=True)
os.kill(-1, signal.SIGKILL)  # everything this code may signal: must stay inside the sandbox
""",
    "setsid_daemon": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.3)
        with open("/tmp/{token}_daemon", "w") as f:
            f.write("still here")
        time.sleep(60)
    os._exit(0)
escaped = False
""",
    "ptrace_unshare": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
escaped = libc.ptrace(16, {victim}, None, None) == 0  # PTRACE_ATTACH
escaped |= libc.ptrace(16, os.getppid(), None, None) == 0
escaped |= libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
escaped |= libc.syscall(165, b"none", b"/tmp", b"tmpfs", 0, None) == 0  # mount
""",
    "proc_mem": """
import os
escaped = False
# the namespace's init (the runner), our parent, a host process
for pid in (1, os.getppid(), {victim}):
    try:  # /proc/<pid>/mem of another process: read or write its memory
        with open(f"/proc/{{pid}}/mem", "r+b", buffering=0) as f:
            print("opened", pid)
            escaped = True
    except OSError as e:
        print("refused:", e)
""",
}

ESCAPE_NAMES = tuple(_PROGRAMS)


def escape_programs(targets: HostTargets, max_processes: int, cap_mb: int) -> dict[str, str]:
    """Name -> source of every escape attempt, aimed at ``targets``."""
    values = dict(token=targets.token, secret=targets.secret, victim=targets.victim.pid,
                  port=targets.port, unix_path=targets.unix_path, abstract=targets.abstract,
                  max_processes=max_processes, cap_mb=cap_mb)  # fmt: skip
    out = {}
    for name, template in _PROGRAMS.items():
        source = template.format(**values)
        out[name] = source if "print('ESCAPED'" in source else source + _END
    return out


class HostTargets:
    """What the escapes aim at, owned by the calling user; ``touched()`` lists what they reached."""

    def __init__(self) -> None:
        self.token = f"areal_escape_{uuid.uuid4().hex[:12]}"
        self.secret = f"sk-areal-{uuid.uuid4().hex}"
        self.unix_path = f"/tmp/{self.token}.sock"
        self.abstract = self.token
        self.victim = subprocess.Popen(  # a server-like process with a key on its command line
            ["/usr/bin/python3", "-c", "import time; time.sleep(120)", f"--api-key={self.secret}"]
        )
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)  # any uid may connect: only the sandbox stops it
        self.abstract_listener = socket.socket(socket.AF_UNIX)
        self.abstract_listener.bind("\0" + self.abstract)
        for s in (self.tcp, self.unix, self.abstract_listener):
            s.listen(4)
            s.setblocking(False)

    def touched(self) -> list[str]:
        """Everything an escape changed on the host (empty when the sandbox held)."""
        out = [p for where in ("/tmp", "/dev/shm") for p in glob.glob(f"{where}/{self.token}_*")]
        if self.victim.poll() is not None:
            out.append(f"victim process killed ({self.victim.returncode})")
        listeners = {"tcp": self.tcp, "unix": self.unix, "abstract": self.abstract_listener}
        for name, s in listeners.items():
            try:
                s.accept()[0].close()
                out.append(f"{name} listener accepted a connection")
            except BlockingIOError:
                pass
        return out

    def clean(self) -> None:
        """Remove what a broken sandbox may have left, so one failure does not leak into others."""
        for where in ("/tmp", "/dev/shm"):
            for p in glob.glob(f"{where}/{self.token}_*"):
                Path(p).unlink(missing_ok=True)

    def close(self) -> None:
        self.clean()
        self.victim.kill()
        self.victim.wait()
        for s in (self.tcp, self.unix, self.abstract_listener):
            s.close()
        Path(self.unix_path).unlink(missing_ok=True)


def processes_of_uid(uid: int) -> set[int]:
    """Pids of live (non-zombie) processes whose real uid is ``uid``."""
    pids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text and "\nState:\tZ" not in text:
            pids.add(int(status.parent.name))
    return pids
