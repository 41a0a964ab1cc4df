"""Runs inside the sandbox (stdlib only, copied into the case's working directory).

It is started as ``python -I -B _runner.py`` by :func:`areal.reward.sandbox.run_python` with the
limits already applied (rlimits, unprivileged uid, namespaces). It installs audit hooks, then
forks: the child runs ``solution.py`` (as ``__main__`` with the case's stdin, or imports it and
calls ``spec["fn_name"](*spec["args"])``, writing the JSON result to ``result.json``); the parent
waits for it and for every orphan (it is PID 1 when a PID namespace is active) and exits with the
child's code, or ``128 + signal`` when the child was killed by a signal.

The audit hooks are a second layer under the kernel limits: they refuse sockets, running other
programs, loading native code through ctypes, and writes, renames or deletes outside the working
directory. Python code can evade audit hooks only through native code, which is why ctypes is
refused; the kernel layer (uid, rlimits, namespaces) does not depend on them.
"""

import json
import os
import sys

_PATH_EVENTS = {
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
    "os.truncate": 1, "os.utime": 1, "os.rename": 2, "os.symlink": 2, "os.link": 2,
    "shutil.rmtree": 1, "shutil.move": 2, "shutil.copyfile": 2,
}  # fmt: skip
_REFUSED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.forkpty", "pty.spawn")  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install_hooks(workdir, block_network):
    realpath, sep = os.path.realpath, os.sep

    def inside(path):
        if isinstance(path, int):
            return True  # an already-open file descriptor
        path = realpath(os.fsdecode(path))
        return path == workdir or path.startswith(workdir + sep) or path == "/dev/null"

    def hook(event, args):
        if event.startswith("socket.") and block_network:
            raise PermissionError(f"sandbox: network access is disabled ({event})")
        if event in _REFUSED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None:
            mode, flags = args[1] or "", args[2] or 0
            writing = any(c in mode for c in "wax+") or flags & _WRITE_FLAGS
            if writing and not inside(args[0]):
                raise PermissionError(f"sandbox: writing outside the working dir: {args[0]!r}")
        n_paths = _PATH_EVENTS.get(event, 0)
        for path in args[:n_paths]:
            if not inside(path):
                raise PermissionError(f"sandbox: {event} outside the working dir: {path!r}")

    sys.addaudithook(hook)


def _run_solution(spec):
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "solution.py", "exec")
    if spec["fn_name"] is None:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        return
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    fn = namespace.get(spec["fn_name"])
    if fn is None and "Solution" in namespace:  # LeetCode style: class Solution: def fn(self, ..)
        fn = getattr(namespace["Solution"](), spec["fn_name"], None)
    if fn is None:
        raise NameError(f"solution.py defines no function {spec['fn_name']!r}")
    result = fn(*spec["args"])
    with open("result.json", "w", encoding="utf-8") as f:
        json.dump({"result": result}, f, default=repr)


def _child(spec):
    try:
        _run_solution(spec)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the submission's own error: reported on stderr, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def _wait_all(child_pid):
    status = 1
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            return status  # no children left (orphans included)
        if pid == child_pid:
            sig = os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else 0
            status = 128 + sig if sig else os.WEXITSTATUS(raw)


def main():
    """Install the hooks, run the solution in a child, exit with its status."""
    workdir = os.path.realpath(os.getcwd())
    with open("spec.json", encoding="utf-8") as f:
        spec = json.load(f)
    _install_hooks(workdir, spec["block_network"])
    child_pid = os.fork()
    if child_pid == 0:
        _child(spec)
    os._exit(_wait_all(child_pid))


if __name__ == "__main__":
    main()
