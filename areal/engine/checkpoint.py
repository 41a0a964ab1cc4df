"""Saving, loading and exporting the weights of an FSDP2-sharded model.

Three formats, three purposes:

- **HF export** (:func:`save_hf`, :func:`load_hf_weights`): one ``model.safetensors`` plus
  ``config.json``, generation config and tokenizer, loadable by plain ``transformers`` and by the
  generation servers. Tied weights are written once (as HF does). Written to a temporary sibling
  dir and renamed into place, so a reader never sees a half-written dir.
- **DCP checkpoint** (:func:`save_dcp`, :func:`load_dcp`): sharded ``torch.distributed.checkpoint``
  of model and optimizer (each rank writes its own shards) plus one small per-rank file with the
  LR scheduler, RNG states and engine counters, for exact recovery at the same world size.
  With ``trainable_only`` (LoRA) the frozen parameters are left out: the checkpoint holds the
  adapters and their optimizer state, the base comes back from the model's ``path``.
  State that every rank holds identically and that only a subclass knows about (e.g. the
  critic's value-normaliser moments) goes next to it as a small JSON file
  (:func:`save_replicated_state`, :func:`load_replicated_state`).

A DCP checkpoint or replicated-state file that cannot be read raises
:class:`~areal.utils.recover.CheckpointError` naming the checkpoint and the file (torch's own
errors name neither); recover checkpoints are also verified against their manifest first
(:mod:`areal.utils.recover`).

Broadcast to inference servers lives in :mod:`areal.utils.weight_sync` (one protocol for both
sides); the engine only feeds it full tensors bucket by bucket.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    DictValueType,
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from areal.utils.recover import CheckpointError, read_torch_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig

TIED_KEYS = ("lm_head.weight",)  # dropped from exports when config.tie_word_embeddings


# ------------------------------------------------------------------------------------ HF format


def export_names(hf_config: PretrainedConfig, names: Iterable[str]) -> list[str]:
    """``names`` minus the tied duplicates HF does not store."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return [n for n in names if not (tied and n in TIED_KEYS)]


def save_hf(
    state: dict[str, torch.Tensor],
    hf_config: PretrainedConfig,
    path: str,
    tokenizer_path: str | None,
    extra: dict | None,
    group: dist.ProcessGroup,
) -> None:
    """Write an HF dir at ``path`` from ``state`` (the engine's ``full_state_dict``: full on
    the mesh's first rank, which writes; ``{}`` on the others). ``extra`` goes to
    areal_meta.json. Collective over ``group`` (every rank of the mesh)."""
    from safetensors.torch import save_file

    if state:
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        keep = export_names(hf_config, state)
        save_file(
            {k: state[k].contiguous() for k in keep},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        hf_config.save_pretrained(tmp)
        _copy_tokenizer(tokenizer_path, tmp)
        (tmp / "areal_meta.json").write_text(json.dumps(extra or {}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    dist.barrier(group=group)


def _copy_tokenizer(src: str | None, dst: Path) -> None:
    if not src:
        return
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "generation_config.json",
    )
    for name in names:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)


def read_hf_weights(path: str, hf_config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in ``path``, with tied duplicates filled in."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}; point path at an HF model dir")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if getattr(hf_config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def load_hf_weights(model: torch.nn.Module, path: str, hf_config: PretrainedConfig) -> None:
    """Load HF safetensors from ``path`` into the sharded model (every rank reads; collective)."""
    state: DictValueType = {**read_hf_weights(path, hf_config)}  # as torch's setter types it
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"weights in {path!r} do not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; load a checkpoint of the same architecture"
        )
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


# ------------------------------------------------------------------------------------ DCP format


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _dcp_options(trainable_only: bool, flat_optim: bool) -> StateDictOptions:
    """Whole model, or its trainable parameters only (a missing one still fails ``dcp.load``).
    ``flat_optim``: optimizer param groups keyed by parameter name, so ranks holding different
    parameters (pipeline stages) do not write one shared ``param_groups`` entry."""
    if trainable_only:
        return StateDictOptions(
            ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=flat_optim
        )
    return StateDictOptions(flatten_optimizer_state_dict=flat_optim)


def save_dcp(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    extra: dict[str, Any],
    group: dist.ProcessGroup,
    trainable_only: bool = False,
    flat_optim: bool = False,
) -> None:
    """Sharded checkpoint of model (+ optimizer), plus scheduler/RNG/``extra`` per rank of
    ``group`` (the model's mesh); ``trainable_only`` leaves frozen parameters out (LoRA);
    ``flat_optim`` keys the optimizer's param groups by parameter (pipeline stages; load with
    the same). Collective over ``group``."""
    opts = _dcp_options(trainable_only, flat_optim)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
    state_dict_saver.save(state, checkpoint_id=path, process_group=group)
    rank_state = {
        "rng": _rng_state(),
        "extra": extra,
        "world_size": dist.get_world_size(group),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    torch.save(rank_state, Path(path) / f"areal_rank{dist.get_rank(group)}.pt")
    dist.barrier(group=group)


def load_dcp(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    group: dist.ProcessGroup,
    trainable_only: bool = False,
    flat_optim: bool = False,
) -> dict[str, Any]:
    """Load what :func:`save_dcp` wrote (same mesh size); returns the saved ``extra``. A file
    that cannot be read raises :class:`~areal.utils.recover.CheckpointError` naming the
    checkpoint and the file. Collective over ``group``."""
    rank_file = Path(path) / f"areal_rank{dist.get_rank(group)}.pt"
    if not rank_file.exists():
        raise FileNotFoundError(
            f"{rank_file} is missing: DCP checkpoint {path!r} was saved at another world size "
            f"(this model's mesh has {dist.get_world_size(group)} ranks); resume with the saved "
            "world size"
        )
    opts = _dcp_options(trainable_only, flat_optim)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
        _dcp_load(state, path, group)
        set_model_state_dict(model, state["model"], options=opts)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path, group)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
    rank_state = read_torch_file(
        rank_file
    )  # after the collective read: a bad file fails one rank alone
    if scheduler is not None and rank_state["scheduler"] is not None:
        scheduler.load_state_dict(rank_state["scheduler"])
    _set_rng_state(rank_state["rng"])
    return rank_state["extra"]


def _dcp_load(state: dict[str, Any], path: str, group: dist.ProcessGroup) -> None:
    """``dcp.load`` whose failure names the checkpoint and its files (DCP's own error names
    neither; every rank of ``group`` raises it)."""
    try:
        state_dict_loader.load(state, checkpoint_id=path, process_group=group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the checkpoint named
        if isinstance(e, CheckpointException):  # one per failed rank, each with its traceback
            cause = "; ".join(
                f"rank {r}: {type(exc).__name__}: {exc}"
                for r, (exc, _) in sorted(e.failures.items())
            )
        else:
            cause = f"{type(e).__name__}: {e}"
        files = sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []
        raise CheckpointError(
            f"DCP checkpoint {path} is unreadable (its "
            f"files: {', '.join(files) or 'none'}): {cause}"
        ) from e


def save_replicated_state(
    path: str, name: str, state: dict[str, Any], group: dist.ProcessGroup
) -> None:
    """Write ``state`` (the same on every rank) as ``path/name`` from ``group``'s first rank.
    Collective over ``group``. With tensor parallelism ``group`` is the data-parallel one, so
    each tp rank's first dp rank writes the same bytes: each through its own temporary file."""
    if dist.get_rank(group) == 0:
        out = Path(path) / name
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, out)  # a reader never sees half a file
    dist.barrier(group=group)


def load_replicated_state(path: str, name: str) -> dict[str, Any]:
    """Read what :func:`save_replicated_state` wrote (every rank reads the same file)."""
    file = Path(path) / name
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: checkpoint {path!r} was saved without this state (e.g. by an "
            "engine configured differently); load it with the same config it was saved with"
        )
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {e})") from e
