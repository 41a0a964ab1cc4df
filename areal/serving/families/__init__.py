"""The architecture table of the embedded generator: one module per served family, each reading
its config.json into an :class:`Architecture` the shared decoder forward
(:class:`areal.serving.model.Qwen2Forward`) runs; Qwen3-MoE's sparse layers run
:mod:`areal.serving.moe` (torch, which nothing here imports: a launcher's preflight reads
configs only). To add a family, see docs/serving.md."""

from __future__ import annotations

from collections.abc import Callable

from areal.serving.families import llama, qwen2, qwen3, qwen3_moe
from areal.serving.families.base import Architecture, UnsupportedModel, refuse

# model_type (config.json) -> how its config reads into an Architecture
FAMILIES: dict[str, Callable[[dict], Architecture]] = {
    qwen2.MODEL_TYPE: qwen2.architecture,
    qwen3.MODEL_TYPE: qwen3.architecture,
    llama.MODEL_TYPE: llama.architecture,
    qwen3_moe.MODEL_TYPE: qwen3_moe.architecture,
}

__all__ = ["FAMILIES", "Architecture", "UnsupportedModel", "architecture_of"]


def architecture_of(config: dict) -> Architecture:
    """``config``'s architecture; :class:`UnsupportedModel` (one line naming the value, the
    served families and ``rollout.backend=vllm|sglang``) for a family or option not served."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise refuse(f"model_type {model_type!r}", f"it serves {', '.join(FAMILIES)}")
    return family(config)
