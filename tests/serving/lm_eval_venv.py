"""A test-only virtual environment holding EleutherAI's lm-evaluation-harness, never a dependency
of ``areal``: it is created once in ``.cache/venv-lm-eval/`` (git-ignored) and reused.

It shares the project venv's packages (torch, transformers, datasets, ...) through a ``.pth``
file naming that venv's site-packages, so pip installs only what lm-eval adds.
``venv --system-site-packages`` would not do this: run from a venv's python it exposes the
*base* interpreter's site-packages, not the venv's. The project venv is never written: pip
installs into the new venv only, and a constraints file pins torch to the version already
installed, so nothing can pull another torch (a CUDA build of GBs).

To keep a clean clone's CI short, lm-eval itself is installed without its dependencies, then
only the ones its CLI and the ``local-completions`` model import (:data:`RUNTIME_DEPS`, found by
running the test's tasks): its metric and other-model dependencies (scikit-learn with scipy,
nltk, evaluate, rouge-score and two more source-only packages that pip would build) are left out.
That is 17 small wheels instead of ~40 packages, ~11 s of CPU instead of ~38 s.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

LM_EVAL = "lm-eval==0.4.13"  # the version issue #23 was tried with
RUNTIME_DEPS = ("sacrebleu", "pytablewriter", "tenacity")  # with their own dependencies
_WANTED = " ".join((LM_EVAL, *RUNTIME_DEPS))  # a venv stamped otherwise is rebuilt
VENV = Path(__file__).resolve().parents[2] / ".cache" / "venv-lm-eval"
INSTALL_DEADLINE_S = 600.0


class LmEvalUnavailable(RuntimeError):
    """pip could not install lm-eval (no registry, no wheel for this Python, ...)."""


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _stamp(venv: Path) -> Path:
    return venv / ".installed"


def ensure_lm_eval(venv: Path = VENV) -> tuple[Path, float]:
    """(python of a venv where ``python -m lm_eval`` runs, seconds spent installing: 0 when
    reused). Raises :class:`LmEvalUnavailable` with pip's own words when pip cannot install it."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp(venv).is_file() and _stamp(venv).read_text() == _WANTED:
            return _python(venv), 0.0
        shutil.rmtree(venv, ignore_errors=True)  # a half-built or outdated one
        start = time.monotonic()
        _build(venv)
        _stamp(venv).write_text(_WANTED)
        return _python(venv), time.monotonic() - start


def _build(venv: Path) -> None:
    import torch

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (purelib / "_areal_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    pip = [
        str(_python(venv)),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "-c",
        str(constraints),
    ]
    deadline = time.monotonic() + INSTALL_DEADLINE_S
    for args in (["--no-deps", LM_EVAL], list(RUNTIME_DEPS)):
        _pip(venv, pip, args, deadline)
    if (purelib / "torch").exists():  # the constraint should make this impossible
        raise RuntimeError(f"pip installed a second torch into {venv}; lm-eval's deps changed")


def _pip(venv: Path, pip: list[str], args: list[str], deadline: float) -> None:
    """Run one pip install; a failure removes the venv and raises :class:`LmEvalUnavailable`
    with pip's error lines."""
    what = " ".join(args)
    try:
        done = subprocess.run(
            pip + args,
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(venv, ignore_errors=True)
        raise LmEvalUnavailable(f"pip install {what} ran past {INSTALL_DEADLINE_S:.0f} s") from None
    if done.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        errors = [
            ln for ln in done.stderr.splitlines() if "ERROR" in ln
        ] or done.stderr.splitlines()[-3:]
        raise LmEvalUnavailable(f"pip install {what} failed: {' | '.join(errors)}")
