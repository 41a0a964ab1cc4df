"""Sandbox containment: every hostile program is stopped and leaves the machine as it was."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from pathlib import Path

import pytest

import areal.reward.sandbox as sandbox
from areal.api.config.reward import SandboxConfig
from areal.reward.code import code_reward, extract_code, normalize_cases, run_tests
from areal.reward.sandbox import Layers, SandboxUnavailable, run_python

CFG = SandboxConfig(case_timeout=2.0, submission_timeout=10.0, cpu_seconds=2)


def _procs_of_uid(uid: int) -> int:
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nUid:\t{uid}\t" in status.read_text():
                n += 1
        except OSError:
            pass
    return n


def _our_children() -> int:
    me = str(os.getpid())
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                n += 1
        except (OSError, IndexError):
            pass
    return n


@pytest.fixture
def unharmed():
    """Yields a checker: no live process of the sandbox uid, none at all (zombies reaped by
    init) within 10 s, and no new children of this test process."""
    baseline = _our_children()

    def check(result):
        if result.uid >= 0:
            assert _procs_of_uid(result.uid) == 0 or _wait_gone(result.uid)
        assert _our_children() <= baseline

    return check


def _wait_gone(uid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _procs_of_uid(uid) == 0:
            return True
        time.sleep(0.2)
    return False


# ----------------------------------------------------------------------------- correct code


def test_correct_stdin_and_function_solutions_pass(unharmed):
    r = run_python("a, b = map(int, input().split())\nprint(a + b)", CFG, stdin="2 3\n")
    assert (r.status, r.stdout) == ("ok", "5\n")
    r = run_python("def add(a, b):\n    return [a + b, (a, b)]", CFG, fn_name="add", args=[2, 3])
    assert r.status == "ok" and r.result == [5, [2, 3]]
    unharmed(r)


def test_code_reward_scores_pass_fraction_or_all_pass():
    completion = "Here:\n```python\nn = int(input())\nprint(n * 2 if n < 5 else n)\n```\n"
    tests = {"inputs": ["1\n", "2\n", "7\n"], "outputs": ["2\n", "4\n", "14\n"]}
    assert code_reward(completion, tests, CFG) == pytest.approx(2 / 3)
    all_pass = SandboxConfig(**{**CFG.__dict__, "scoring": "all_pass"})
    assert code_reward(completion, tests, all_pass) == 0.0
    calls = [{"fn_name": "f", "args": [3], "expected": 9.0}]
    assert code_reward("def f(x):\n    return x ** 2\n", calls, CFG) == 1.0


def test_cases_normalize_from_apps_layout_and_reject_bad_cases():
    cases = normalize_cases('{"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}')
    assert cases == [{"fn_name": "add", "args": [1, 2], "expected": 3}]
    with pytest.raises(ValueError, match="case 0 has keys"):
        normalize_cases([{"stdin": "1"}])
    assert extract_code("x\n```py\nprint(1)\n```\n```\nprint(2)\n```") == "print(1)\n"


# ----------------------------------------------------------------------------- hostile code


def test_infinite_loop_is_stopped_at_the_deadline(unharmed):
    start = time.monotonic()
    r = run_python("while True:\n    pass", CFG)
    assert r.status == "timeout"
    assert time.monotonic() - start < CFG.case_timeout + 3
    unharmed(r)


def test_writes_land_in_private_tmpfs_and_the_working_dir_is_writable(unharmed):
    token = f"areal_private_{uuid.uuid4().hex}"
    code = (f"open('/tmp/{token}', 'w').write('x')\nopen('/dev/shm/{token}', 'w').write('x')\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")  # fmt: skip
    r = run_python(code, CFG)
    assert (r.status, r.stdout) == ("ok", "ok\n")
    assert not Path(f"/tmp/{token}").exists() and not Path(f"/dev/shm/{token}").exists()
    r = run_python(f"open('/usr/{token}', 'w')", CFG)  # everything else is read-only
    assert r.status == "runtime_error" and "Read-only file system" in r.stderr
    unharmed(r)


def test_environment_is_empty(monkeypatch, unharmed):
    monkeypatch.setenv("AREAL_TEST_SECRET", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ.items()))", CFG)
    assert r.status == "ok" and "hunter2" not in r.stdout and "AREAL_TEST_SECRET" not in r.stdout
    unharmed(r)


def test_output_is_capped(unharmed):
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", CFG)
    assert r.status in ("output_limit", "runtime_error", "timeout")
    assert len(r.stdout) <= CFG.max_output_bytes
    unharmed(r)


def test_submission_deadline_skips_remaining_cases():
    cfg = SandboxConfig(case_timeout=1.0, submission_timeout=1.5, cpu_seconds=1)
    res = run_tests("while True:\n    pass", [{"input": "", "output": ""}] * 3, cfg)
    assert res.passed == 0 and res.statuses[-1] == "skipped_deadline"


def test_code_reward_runs_inside_a_reward_worker():
    from areal.api.config.reward import RewardConfig
    from areal.reward.runner import RewardRunner

    tests = [{"input": "4\n", "output": "16\n"}, {"fn_name": "sq", "args": [3], "expected": 9}]
    code = ("```python\ndef sq(x):\n    return x * x\n"
            "if __name__ == '__main__':\n    print(sq(int(input())))\n```")  # fmt: skip
    with RewardRunner(code_reward, RewardConfig(n_workers=1)) as runner:
        assert runner.call("code-0", code, tests) == 1.0
        assert runner.commit_batch()["reward/n_failed"] == 0


def test_required_isolation_refuses_to_run_without_a_layer_and_names_the_fix(monkeypatch):
    missing = Layers(namespaces=False, seccomp=True, missing=("namespaces: bwrap (bubblewrap) "
                     "is not on PATH; fix: apt-get install bubblewrap",))  # fmt: skip
    monkeypatch.setattr(sandbox, "probe_layers", lambda python: missing)
    fix = "apt-get install bubblewrap.*isolation=best_effort"
    with pytest.raises(SandboxUnavailable, match=fix):
        run_python("print(1)", CFG)


PROCESS_COUNT = """
import os, time
n = 0  # processes started, at most 100
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
finally:
    print(n, flush=True)
    os._exit(0)
"""


def test_best_effort_without_namespaces_keeps_seccomp_and_rlimits_and_says_so(
    monkeypatch, unharmed
):
    missing = Layers(namespaces=False, seccomp=True, missing=("namespaces: off for this test",))
    monkeypatch.setattr(sandbox, "probe_layers", lambda python: missing)
    cfg = dataclasses.replace(CFG, isolation="best_effort")
    r = run_python("print(input()[::-1])", cfg, stdin="abc\n")
    assert r.stdout == "cba\n"
    assert r.isolation == ("seccomp+rlimits+uid" if os.geteuid() == 0 else "seccomp+rlimits")
    hostile = ["import subprocess\nsubprocess.run(['/bin/true'])", "import os\nos.mkfifo('f')",
               "import socket\nsocket.socket()"]  # fmt: skip
    for code in hostile:
        r = run_python(code + "\nprint('ran')", cfg)
        assert r.status == "runtime_error" and "ran" not in r.stdout, r
    r = run_python(PROCESS_COUNT, cfg)
    assert int(r.stdout) <= CFG.max_processes, r  # the cap holds without a user namespace too
    unharmed(r)


def test_a_result_nested_past_the_parsers_depth_scores_zero_as_bad_result():
    # Writes 100,000-deep JSON to its result descriptor (found in the runner's spec.json) and
    # exits before the runner writes the real result: json.loads raised RecursionError, which
    # escaped code_reward (a failed reward call instead of a score).
    code = (
        "import json, os, sys\n"
        "def f():\n"
        "    spec = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), 'spec.json')\n"
        "    fd = json.load(open(spec))['result_fd']\n"
        "    os.write(fd, b'{\"result\": ' + b'[' * 100000 + b']' * 100000 + b'}')\n"
        "    os._exit(0)\n"
    )
    cases = [{"fn_name": "f", "args": [], "expected": 1}]
    assert run_tests(code, cases, CFG).statuses == ["bad_result"]
    assert code_reward(f"```python\n{code}```", cases, CFG) == 0.0


def test_a_submission_cannot_forge_the_sandbox_error_label():
    # The sandbox's own failure used to be read from stderr: a submission printing the prefix
    # first was labelled sandbox_error. Now only the runner's "ready" descriptor counts.
    res = run_python(
        "import sys\nsys.stderr.write('areal-sandbox: setup failed\\n')\nsys.exit(125)", CFG
    )
    assert res.status == "runtime_error", res
    res = run_python("import sys\nsys.stderr.write('bwrap: cannot mount\\n')", CFG)
    assert res.status == "ok", res
