"""Code reward: run model-written Python against test cases in the sandbox.

Test cases (``reference`` of a code item) are a list of dicts, one of two kinds::

    {"input": "1 2\\n", "output": "3\\n"}                       # stdin -> stdout
    {"fn_name": "add", "args": [1, 2], "expected": 3}           # function call

or the APPS/TACO layout ``{"inputs": [...], "outputs": [...], "fn_name": optional}`` (also as a
JSON string), converted by :func:`normalize_cases`. Stdout is compared line by line with trailing
whitespace and trailing blank lines ignored; call results are compared after a JSON round trip
(tuples become lists), floats to 1e-6 relative.

Each case runs in its own sandboxed process (:func:`areal.reward.sandbox.run_python`) with the
per-case deadline; cases after the submission deadline are not run and count as failed. With
``reward.sandbox.isolation=required`` (the default) a machine that lacks a sandbox layer raises
:class:`areal.reward.sandbox.SandboxUnavailable` naming it: an infrastructure error, never a
score. What the sandbox guarantees per mode is in docs/sandbox.md.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from areal.api.config.reward import SandboxConfig
from areal.reward.sandbox import SandboxResult, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced python block (else the last fenced block, else the whole completion)."""
    blocks = _FENCE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def normalize_cases(tests: Any) -> list[dict]:
    """Test cases in this module's list-of-dicts form (accepts the APPS layout and JSON text)."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if inputs is None or outputs is None or len(inputs) != len(outputs):
            raise ValueError(
                "code tests: an APPS-style dict needs 'inputs' and 'outputs' lists of equal "
                f"length, got keys {sorted(tests)}"
            )
        fn_name = tests.get("fn_name")
        if fn_name:
            return [
                {"fn_name": fn_name, "args": list(i), "expected": o[0] if _single(o) else o}
                for i, o in zip(inputs, outputs)
            ]
        return [{"input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs)]
    cases = list(tests)
    for k, case in enumerate(cases):
        if not ({"input", "output"} <= set(case) or {"fn_name", "expected"} <= set(case)):
            raise ValueError(
                f"code tests: case {k} has keys {sorted(case)}; a case needs input+output "
                "(stdin/stdout) or fn_name+args+expected (function call)"
            )
    return cases


def _single(outputs: Any) -> bool:
    # APPS wraps each expected return value in a one-element list.
    return isinstance(outputs, list) and len(outputs) == 1


def _text(value: Any) -> str:
    return "\n".join(value) if isinstance(value, list) else str(value)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def values_equal(got: Any, expected: Any) -> bool:
    """Equality after a JSON round trip, with floats compared to 1e-6 relative."""
    if isinstance(got, float) or isinstance(expected, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(map(values_equal, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    return json.loads(json.dumps(got, default=repr)) == json.loads(
        json.dumps(expected, default=repr)
    )


def case_passed(case: dict, result: SandboxResult) -> bool:
    """Whether one sandbox run satisfies its case."""
    if result.status != "ok":
        return False
    if "fn_name" in case:
        return values_equal(result.result, case["expected"])
    return _lines(result.stdout) == _lines(str(case["output"]))


@dataclass
class CodeResult:
    """Per-case outcomes of one submission."""

    passed: int
    total: int
    statuses: list[str] = field(default_factory=list)  # per case: sandbox status or "wrong"
    isolation: str = ""

    @property
    def fraction(self) -> float:
        """Passed / total (0.0 without cases)."""
        return self.passed / self.total if self.total else 0.0


def run_tests(code: str, tests: Any, cfg: SandboxConfig) -> CodeResult:
    """Run every case of ``tests`` against ``code``, within the per-case and submission
    deadlines."""
    cases = normalize_cases(tests)
    deadline = time.monotonic() + cfg.submission_timeout
    out = CodeResult(passed=0, total=len(cases))
    for case in cases:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            out.statuses.append("skipped_deadline")
            continue
        timeout = min(cfg.case_timeout, remaining)
        if "fn_name" in case:
            res = run_python(code, cfg, fn_name=case["fn_name"], args=case.get("args", []),
                             timeout=timeout)  # fmt: skip
        else:
            res = run_python(code, cfg, stdin=str(case["input"]), timeout=timeout)
        ok = case_passed(case, res)
        out.passed += ok
        out.statuses.append("passed" if ok else ("wrong" if res.status == "ok" else res.status))
        out.isolation = res.isolation
    return out


def code_reward(completion: str, tests: Any, cfg: SandboxConfig | None = None) -> float:
    """Reward of a completion's code: pass fraction or all-pass (``cfg.scoring``)."""
    cfg = cfg or SandboxConfig()
    result = run_tests(extract_code(completion), tests, cfg)
    if cfg.scoring == "all_pass":
        return 1.0 if result.total and result.passed == result.total else 0.0
    return result.fraction
