"""The one place that knows how each server kind is started (ours, SGLang, vLLM), and how a
started server is kept alive (:class:`ManagedServer`: restarted on its port with the newest
published weights when it dies)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from areal.api.config import to_dict
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


def server_command(cfg, port: int, config_path: Path, model: str = "", version: int = 0,
                   host: str = "127.0.0.1") -> list[str]:
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
        exe = shutil.which("vllm")
        if exe is None:
            _require("vllm", "vllm")
        return [
            exe or "vllm", "serve", model, "--host", host, "--port", str(port),
            "--served-model-name", cfg.rollout.served_model_name,
        ]  # fmt: skip
    raise ValueError(f"rollout.backend={backend!r} is not one of areal, sglang, vllm")


def _restartable(cfg) -> str:
    """Why a dead server cannot be restarted ('' if it can)."""
    if cfg.rollout.backend != "areal":
        return f"rollout.backend={cfg.rollout.backend} servers are not restarted"
    if getattr(cfg, "weight_update_mode", "disk") != "disk":
        return "a restarted server cannot join the running weight broadcast group (weight_update_mode=distributed)"
    return ""


@dataclass
class ManagedServer:
    """One generation server under a :class:`ProcessSupervisor`, restarted on its port when it
    dies (every launcher uses it: locally, or on a cluster node through ``server_task``)."""

    child: Child
    host: str
    port: int
    env: dict[str, str]
    restarts: int = 0

    @classmethod
    def start(cls, sup: ProcessSupervisor, cfg, name: str, port: int, env: dict[str, str],
              host: str = "127.0.0.1") -> ManagedServer:
        """Start server ``name`` on ``host:port`` with the actor's initial weights."""
        cmd = server_command(cfg, port, cfg.run_dir / f"{name}.yaml", host=host)
        return cls(sup.start(name, cmd, env=env), host, port, env)

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
        ``launcher.server_restarts`` times; False (logged with the reason) if it stays dead."""
        child, limit = self.child, cfg.launcher.server_restarts
        why = _restartable(cfg) or (f"it was restarted {limit} time(s) already (launcher.server_restarts)"
                                    if self.restarts >= limit else "")
        if why:
            logger.error(f"{child.name} exited with code {child.proc.returncode}; not restarting it: {why}. "
                         f"The trainer continues on the other servers. Last lines:\n{child.tail(10)}")
            return False
        model, version = newest_weights(cfg.weights_dir) or (cfg.served_model_path, 0)
        self.restarts += 1
        logger.error(f"{child.name} exited with code {child.proc.returncode}; restarting it on port {self.port} "
                     f"with weights version {version} ({self.restarts} of {limit}). Last lines:\n{child.tail(10)}")
        cmd = server_command(cfg, self.port, cfg.run_dir / f"{child.name}.yaml", model, version, self.host)
        sup.children.remove(child)
        self.child = sup.start(child.name, cmd, env=self.env)
        return True


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(
            f"rollout.backend={module} but {module} is not installed here; "
            f"`pip install -e '.[{extra}]'` in the areal checkout on a CUDA machine, or use rollout.backend=areal"
        )
