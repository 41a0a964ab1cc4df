"""House rule: no dead code in the library or the entry scripts (vulture, 60% confidence).

Whatever vulture reports is removed, or listed with its reason in tests/dead_code_allowlist.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_vulture_finds_no_unused_code():
    cmd = [
        sys.executable,
        "-m",
        "vulture",
        "areal",
        "examples",
        "tests/dead_code_allowlist.py",
        "--min-confidence",
        "60",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (
        "dead code (remove it, or add it to tests/dead_code_allowlist.py with a reason):\n"
        + out.stdout
        + out.stderr
    )
