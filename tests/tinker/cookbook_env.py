"""A test-only virtual environment holding ``tinker-cookbook``, never a dependency of ``areal``:
it is created once in ``.cache/venv-tinker-cookbook/`` (git-ignored) and reused.

Why its own venv: tinker-cookbook 0.5.8 pins ``transformers<=5.5.4`` (the project venv has a
newer one) and ``tml-renderers``. 0.5.8 is the newest that installs from this project's package
index: 0.6.x needs ``tml-renderers>=0.4.1``, which the index lacks (its newest is 0.2.1).

The cookbook asks for ``torch>=2.10``; a constraint pins it to the project venv's torch version
(2.13.0, the CPU wheel the Makefile installs), so pip never pulls a CUDA torch and its ~3 GB of
``nvidia-*`` wheels. pip's cache is ``.cache/pip``, so a rebuild downloads nothing.

:func:`ensure` builds or reuses it and never raises: on failure it returns the reason (pip's own
error lines) and the cookbook test skips with exactly that text. ``python
tests/tinker/cookbook_env.py`` builds it and prints the outcome.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
VENV = CACHE / "venv-tinker-cookbook"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
REQUIREMENTS = ("tinker==0.38.0", "tinker-cookbook==0.5.8")
INSTALL_DEADLINE_S = 900.0  # a cold install (~80 wheels) took ~3.5 min on a busy 2-core box


def _torch_pin() -> str:
    """The project venv's torch, without its local label (``2.13.0+cpu`` -> ``torch==2.13.0``)."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def _wanted() -> str:
    return " ".join((*REQUIREMENTS, _torch_pin()))  # a venv stamped otherwise is rebuilt


def _run(cmd: list[str], deadline: float) -> None:
    """Run one build command; raise RuntimeError with its last error lines when it fails."""
    env = dict(os.environ, PIP_CACHE_DIR=str(CACHE / "pip"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)  # nothing of the project venv leaks into the cookbook's
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=max(1.0, deadline - time.time())
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd[:5])} ...` ran past {INSTALL_DEADLINE_S:g} s") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
        noise = ("WARNING: Location", "ERROR: Ignored the following")  # index and Python notes
        lines = [ln for ln in lines if not ln.startswith(noise)]
        errors = [ln for ln in lines if "ERROR" in ln or "Error" in ln] or lines[-3:]
        raise RuntimeError(
            f"`{' '.join(cmd[:5])} ...` exited {done.returncode}: " + " | ".join(errors)
        )


def _build() -> None:
    deadline = time.time() + INSTALL_DEADLINE_S
    _run([sys.executable, "-m", "venv", str(VENV)], deadline)
    constraints = VENV / "constraints.txt"
    constraints.write_text(_torch_pin() + "\n")
    _run(
        [str(PYTHON), "-m", "pip", "install", "-q", "-c", str(constraints), *REQUIREMENTS], deadline
    )
    check = (
        "import importlib.metadata as m, tinker_cookbook.recipes.sl_basic; "
        "cuda = [d.name for d in m.distributions() if (d.name or '').startswith('nvidia')]; "
        "assert not cuda, f'CUDA wheels pulled in: {cuda}'"
    )
    _run([str(PYTHON), "-c", check], deadline)


def ensure() -> tuple[Path | None, str]:
    """``(python, "")`` of a venv where ``python -m tinker_cookbook.recipes.sl_basic`` runs,
    built now unless already built for :func:`_wanted`; ``(None, reason)`` when it cannot be."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "venv-tinker-cookbook.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        wanted = _wanted()
        if STAMP.is_file() and STAMP.read_text() == wanted:
            return PYTHON, ""
        shutil.rmtree(VENV, ignore_errors=True)  # a half-built or outdated one
        try:
            _build()
        except (RuntimeError, OSError) as e:
            shutil.rmtree(VENV, ignore_errors=True)
            return None, f"tinker-cookbook venv could not be built ({wanted} into {VENV}): {e}"
        STAMP.write_text(wanted)
        return PYTHON, ""


def main() -> None:
    """Build or reuse, print the outcome, exit 0 either way."""
    start = time.monotonic()
    python, reason = ensure()
    if python is None:
        print(f"tinker-cookbook-env: SKIPPING the cookbook test: {reason}")
    else:
        print(f"tinker-cookbook-env: ready ({python}, {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
