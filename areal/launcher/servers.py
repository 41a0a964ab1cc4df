"""The one place that knows how each server kind is started (ours, SGLang, vLLM)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import yaml

from areal.api.config import to_dict


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


def server_command(cfg, port: int, config_path: Path, model: str = "", version: int = 0) -> list[str]:
    """Command line for one server on 127.0.0.1:``port`` serving ``model`` (default
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
            "--model", model, "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
    if backend == "sglang":
        _require("sglang", "sglang")
        return [
            sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
    if backend == "vllm":
        exe = shutil.which("vllm")
        if exe is None:
            _require("vllm", "vllm")
        return [
            exe or "vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", cfg.rollout.served_model_name,
        ]  # fmt: skip
    raise ValueError(f"rollout.backend={backend!r} is not one of areal, sglang, vllm")


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(
            f"rollout.backend={module} but {module} is not installed here; "
            f"`pip install areal[{extra}]` on a CUDA machine, or use rollout.backend=areal"
        )
