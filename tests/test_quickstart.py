"""Tier 1: what the demo's last lines tell the user to type."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from areal.quickstart import areal_command


def test_demo_names_the_venv_script_when_the_shell_path_does_not_reach_it(tmp_path):
    # make demo installs into .venv without activating it: a bare `areal` would not be found
    expected = os.path.relpath(Path(sys.executable).parent / "areal")
    assert areal_command(path_env=str(tmp_path)) == expected
    assert expected.endswith(os.path.join("bin", "areal"))


def test_demo_says_plain_areal_when_the_shell_finds_this_installation():
    assert areal_command(path_env=str(Path(sys.executable).parent)) == "areal"
