"""LoRA adapters on the FSDP engine, through ``peft``.

A LoRA linear computes ``y = W x + (alpha / r) * B (A dropout(x))`` with ``W`` frozen, ``A``
``[r, in]`` (random init) and ``B`` ``[out, r]`` (zero init, so training starts at the base
model). :func:`apply_lora` wraps the Hugging Face model with ``peft.get_peft_model`` *before*
FSDP shards it, so the adapters are sharded like any other parameter; only they (and a value /
score head, kept whole through peft's ``modules_to_save``) require grad, so only they get
gradients and optimizer state; ``lora.modules_to_save`` (e.g. ``embed_tokens``) adds whole
modules to them, a tied ``lm_head`` following its embeddings. The base keeps the engine's
``dtype`` (``bfloat16`` keeps it in bf16 on GPU); peft keeps the adapters in float32 whatever
the base dtype.

What leaves the trainer is always the merged model under plain HF names: weight updates to the
generation servers and HF exports carry ``W + (alpha / r) * B @ A`` (:func:`merge_plan`,
:func:`merged_tensor`), computed from the full tensors one at a time, so the servers need no
LoRA support. The adapter alone is saved in peft's own layout (:func:`save_adapter`, loadable
with ``peft.PeftModel.from_pretrained``); recover checkpoints hold the adapters and their
optimizer state only (the frozen base is rebuilt from ``path``).

The reference model of a KL term is the frozen base: :class:`FrozenBase` computes logprobs
with the adapters disabled (peft's ``disable_adapter()``), no second copy of the weights (only a
module trained in full keeps its frozen original next to the trained copy).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from areal.api.config.engine import LoRAConfig
from areal.api.engine import ModelFnResult
from areal.api.mfc import model_fn
from areal.utils.batch import PackedBatch

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

    from areal.engine.fsdp import FSDPEngine

VALUE_HEAD = "score"  # AutoModelForTokenClassification's head (critic, reward model)
PEFT_PREFIX = "base_model.model."  # a PeftModel's state-dict keys start with it
ADAPTER = "default"  # peft's adapter name
ADAPTER_DIR = "adapter"  # inside an HF export: the adapter alone, in peft's layout


def peft_config(cfg: LoRAConfig, head: str) -> LoraConfig:
    """The ``peft.LoraConfig`` of ``cfg``; a value head (``head="value"``) stays fully
    trainable (``modules_to_save``) and never gets an adapter; ``cfg.modules_to_save`` are
    trained in full too, weights tied to them (a tied ``lm_head``) staying tied."""
    from peft import LoraConfig

    targets = (
        "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    )
    value = head == "value"
    save = [*cfg.modules_to_save, *([VALUE_HEAD] if value else [])]
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # pyright: ignore[reportArgumentType]  # peft: int; uses alpha / r
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        modules_to_save=save or None,
        exclude_modules=[VALUE_HEAD] if value else None,
        ensure_weight_tying=bool(cfg.modules_to_save),
    )


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, head: str, seed: int) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` (adapters initialised from ``seed``, the same
    on every rank); raises naming ``lora.target_modules`` when nothing matched."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = get_peft_model(model, peft_config(cfg, head))
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(
                f"lora.target_modules={list(cfg.target_modules)} does not fit "
                f"{type(model).__name__}: {e}; name its linear layers (e.g. q_proj, "
                "v_proj) or use [all-linear]"
            ) from e
    if not any("lora_" in n for n, _ in wrapped.named_parameters()):
        raise ValueError(
            f"lora.target_modules={list(cfg.target_modules)} matched no linear layer of "
            f"{type(model).__name__}; name its linear layers or use [all-linear]"
        )
    saved = {
        n.split(f".modules_to_save.{ADAPTER}.")[0]
        for n, _ in wrapped.named_parameters()
        if f".modules_to_save.{ADAPTER}." in n
    }
    missing = [
        m for m in cfg.modules_to_save if not any(s == m or s.endswith(f".{m}") for s in saved)
    ]
    if missing:  # peft skips a name that matches nothing
        raise ValueError(
            f"lora.modules_to_save={list(cfg.modules_to_save)}: {missing} matched no module "
            f"of {type(model).__name__}; name modules by suffix, e.g. embed_tokens"
        )
    return wrapped


def peft_model(model: torch.nn.Module) -> PeftModel:
    """``model`` as the PeftModel :func:`apply_lora` made (FSDP's class subclasses it)."""
    from peft import PeftModel

    assert isinstance(model, PeftModel), f"not a LoRA model: {type(model).__name__}"
    return model


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a PeftModel (``model`` itself when not wrapped)."""
    get = getattr(model, "get_base_model", None)
    if not callable(get):
        return model
    base = get()
    assert isinstance(base, torch.nn.Module)  # peft's get_base_model returns the wrapped model
    return base


# ------------------------------------------------------------------------------ merged export


@dataclass(frozen=True)
class Source:
    """Where one exported (HF-named) tensor comes from in the PeftModel's state dict: ``base``
    alone, or ``base + scaling * b @ a``."""

    base: str
    a: str | None = None
    b: str | None = None


def _strip(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


def merge_plan(keys) -> dict[str, Source]:
    """HF name -> :class:`Source` for every tensor of the merged model, in ``keys`` order.

    ``X.base_layer.W`` (+ ``X.lora_A/B.default.weight``) -> ``X.W``; ``X.modules_to_save.default.W``
    -> ``X.W`` (the trained head; its frozen ``original_module`` copy is dropped)."""
    keys = list(keys)
    present = set(keys)
    plan: dict[str, Source] = {}
    for key in keys:
        name = _strip(key)
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            a = f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight"
            b = f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight"
            lora = leaf == "weight" and a in present
            plan[f"{module}.{leaf}"] = Source(key, a, b) if lora else Source(key)
        elif f".modules_to_save.{ADAPTER}." in name:
            plan[name.replace(f".modules_to_save.{ADAPTER}.", ".")] = Source(key)
        else:
            plan[name] = Source(key)
    return plan


def merged_tensor(src: Source, get: Callable[[str], torch.Tensor], scaling: float) -> torch.Tensor:
    """The exported tensor of ``src``: ``W + scaling * B @ A`` in float32, in ``W``'s dtype;
    ``get(key)`` returns a full tensor of the PeftModel's state dict."""
    base = get(src.base)
    if src.a is None:
        return base
    assert src.b is not None  # merge_plan sets a and b together
    delta = get(src.b).float() @ get(src.a).float()
    return (base.float() + scaling * delta).to(base.dtype)


def merge_state_dict(state: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """The merged HF state dict of a full PeftModel state dict (``{}`` stays ``{}``)."""
    if not state:
        return {}
    scaling = cfg.alpha / cfg.rank
    return {
        name: merged_tensor(src, state.__getitem__, scaling)
        for name, src in merge_plan(state).items()
    }


# ------------------------------------------------------------------------------ adapter dir


def save_adapter(
    model: torch.nn.Module, state: dict[str, torch.Tensor], path: str, base_path: str
) -> None:
    """Write the adapter of ``model`` (a PeftModel; ``state`` its full state dict) at ``path``
    in peft's layout (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
    ``PeftModel.from_pretrained(<base model from base_path>, path)``. Called on one rank."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    peft = peft_model(model)
    adapter = get_peft_model_state_dict(peft, state_dict=state, save_embedding_layers=False)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in adapter.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = peft.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = base_path
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


# ------------------------------------------------------------------------------ reference


class FrozenBase:
    """The reference policy of a LoRA actor: its own base weights, adapters disabled.

    Used instead of a second engine when ``ref`` is unset and the actor trains LoRA adapters
    (examples/gsm8k_grpo.py): ``compute_logp`` runs the actor's sharded model under peft's
    ``disable_adapter()``, so the logprobs are the frozen base's, at no extra memory.
    """

    def __init__(self, actor: FSDPEngine):
        if not actor.config.lora.enabled:
            raise ValueError(
                "FrozenBase needs an actor with lora.rank > 0 (its base is frozen); "
                "without LoRA configure a separate `ref` model"
            )
        self.actor: FSDPEngine | None = actor

    @model_fn(named={"out": "logp"})
    def compute_logp(self, batch: PackedBatch, out: str = "logp") -> ModelFnResult:
        """``batch`` plus token field ``out``: the base model's logprobs (adapters off)."""
        if self.actor is None:
            raise RuntimeError("FrozenBase.compute_logp after destroy(); build a new FrozenBase")
        with peft_model(self.actor.model).disable_adapter():
            return self.actor.compute_logp(batch, out=out)

    def destroy(self) -> None:
        """Drops the reference to the actor (the weights are the actor's; it frees them)."""
        self.actor = None
