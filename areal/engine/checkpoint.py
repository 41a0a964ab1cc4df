"""Saving, loading and exporting the weights of an FSDP2-sharded model.

Three formats, three purposes:

- **HF export** (:func:`save_hf`, :func:`load_hf_weights`): one ``model.safetensors`` plus
  ``config.json``, generation config and tokenizer, loadable by plain ``transformers`` and by the
  generation servers. Tied weights are written once (as HF does). Written to a temporary sibling
  dir and renamed into place, so a reader never sees a half-written dir.
- **DCP checkpoint** (:func:`save_dcp`, :func:`load_dcp`): sharded ``torch.distributed.checkpoint``
  of model and optimizer (each rank writes its own shards) plus one small per-rank file with the
  LR scheduler, RNG states and engine counters, for exact recovery at the same world size.
- **Broadcast** (:func:`broadcast_weights` / :func:`receive_weights`) over a process group the
  inference servers join (:func:`init_weight_update_group`). Protocol, all broadcasts from group
  rank 0 (the trainer's rank 0):

  1. header length: int64 tensor ``[1]`` = number of bytes of the JSON header;
  2. header: uint8 tensor of UTF-8 JSON ``{"version": int, "tensors": [{"name", "dtype",
     "shape"}, ...], "buckets": [[tensor index, ...], ...]}`` (names are HF names, dtypes are
     ``torch`` dtype names such as ``"float32"``);
  3. one uint8 tensor per bucket: the raw bytes of its tensors, concatenated in listed order;
     a bucket holds at most ``bucket_bytes`` unless a single tensor is larger.

  Receivers rebuild every tensor bit for bit (``view(dtype).reshape(shape)``).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from areal.api.io import WeightUpdateMeta

TIED_KEYS = ("lm_head.weight",)  # dropped from exports when config.tie_word_embeddings


# ------------------------------------------------------------------------------------ HF format


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on rank 0 (other ranks get ``{}``). Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_names(hf_config: Any, names: Iterable[str]) -> list[str]:
    """``names`` minus the tied duplicates HF does not store."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return [n for n in names if not (tied and n in TIED_KEYS)]


def save_hf(
    model: torch.nn.Module, hf_config: Any, path: str, tokenizer_path: str | None, extra: dict | None = None
) -> None:
    """Write an HF dir at ``path`` (collective; rank 0 writes). ``extra`` goes to areal_meta.json."""
    from safetensors.torch import save_file

    state = full_state_dict(model)
    if dist.get_rank() == 0:
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        keep = export_names(hf_config, state)
        save_file({k: state[k].contiguous() for k in keep}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        _copy_tokenizer(tokenizer_path, tmp)
        (tmp / "areal_meta.json").write_text(json.dumps(extra or {}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    dist.barrier()


def _copy_tokenizer(src: str | None, dst: Path) -> None:
    if not src:
        return
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt", "chat_template.jinja", "generation_config.json")
    for name in names:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)


def read_hf_weights(path: str, hf_config: Any) -> dict[str, torch.Tensor]:
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


def load_hf_weights(model: torch.nn.Module, path: str, hf_config: Any) -> None:
    """Load HF safetensors from ``path`` into the sharded model (every rank reads; collective)."""
    state = read_hf_weights(path, hf_config)
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
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_dcp(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             scheduler: Any, extra: dict[str, Any]) -> None:
    """Sharded checkpoint of model (+ optimizer), plus scheduler/RNG/``extra`` per rank."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=path)
    rank_state = {"rng": _rng_state(), "extra": extra, "world_size": dist.get_world_size(),
                  "scheduler": scheduler.state_dict() if scheduler is not None else None}
    torch.save(rank_state, Path(path) / f"areal_rank{dist.get_rank()}.pt")
    dist.barrier()


def load_dcp(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             scheduler: Any) -> dict[str, Any]:
    """Load what :func:`save_dcp` wrote (same world size); returns the saved ``extra``."""
    rank_file = Path(path) / f"areal_rank{dist.get_rank()}.pt"
    if not rank_file.exists():
        raise FileNotFoundError(
            f"{rank_file} is missing: DCP checkpoint {path!r} was saved at another world size "
            f"(this run has {dist.get_world_size()} ranks); resume with the saved world size"
        )
    rank_state = torch.load(rank_file, weights_only=False)
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    if scheduler is not None and rank_state["scheduler"] is not None:
        scheduler.load_state_dict(rank_state["scheduler"])
    _set_rng_state(rank_state["rng"])
    return rank_state["extra"]


# ------------------------------------------------------------------------------------ broadcast


def init_weight_update_group(meta: WeightUpdateMeta, rank: int, world_size: int,
                             timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join the trainer(rank 0)+servers group at ``meta.master_address:master_port``.

    The group is separate from the trainers' default group (a TCPStore hosted by rank 0 and a
    raw gloo/NCCL process group), so servers never join the trainers' world.
    """
    if meta.master_port <= 0:
        raise ValueError(f"WeightUpdateMeta.master_port must be a free port, got {meta.master_port}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(meta.master_address, meta.master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=True)
    store = dist.PrefixStore(meta.group_name, store)
    if meta.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _bcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))


def plan_buckets(specs: list[dict[str, Any]], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices grouped into buckets of at most ``bucket_bytes``."""
    buckets: list[list[int]] = []
    size = 0
    for i, s in enumerate(specs):
        n = int(np.prod(s["shape"], dtype=np.int64)) * torch.empty((), dtype=_dtype(s["dtype"])).element_size()
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight header")
    return dtype


def tensor_spec(name: str, t: torch.Tensor) -> dict[str, Any]:
    """The header entry of one tensor."""
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def broadcast_weights(specs: list[dict[str, Any]], tensors: Iterator[torch.Tensor],
                      group: dist.ProcessGroup | None, bucket_bytes: int, version: int,
                      device: torch.device, timeout_s: float = 300.0) -> None:
    """Send header then buckets (group rank 0). ``tensors`` yields full tensors in ``specs`` order.

    ``group=None`` consumes ``tensors`` without sending (trainer ranks > 0 still take part in
    the all-gathers that produce each full tensor).
    """
    buckets = plan_buckets(specs, bucket_bytes)
    if group is not None:
        header = json.dumps({"version": version, "tensors": specs, "buckets": buckets}).encode()
        _bcast(group, torch.tensor([len(header)], dtype=torch.int64, device=device), timeout_s)
        _bcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), timeout_s)
    for bucket in buckets:
        parts = [next(tensors).detach().contiguous().reshape(-1).view(torch.uint8) for _ in bucket]
        if group is not None:
            _bcast(group, torch.cat(parts).to(device), timeout_s)


def receive_weights(group: dist.ProcessGroup, device: torch.device | str = "cpu",
                    timeout_s: float = 300.0) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Receiver side: returns (version, iterator of (name, tensor)); consume it fully."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    _bcast(group, length, timeout_s)
    raw = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    _bcast(group, raw, timeout_s)
    header = json.loads(bytes(raw.cpu().numpy()).decode())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in header["buckets"]:
            specs = [header["tensors"][i] for i in bucket]
            dtypes = [_dtype(s["dtype"]) for s in specs]
            sizes = [int(np.prod(s["shape"], dtype=np.int64)) * torch.empty((), dtype=d).element_size()
                     for s, d in zip(specs, dtypes)]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            _bcast(group, buf, timeout_s)
            for s, d, part in zip(specs, dtypes, torch.split(buf, sizes)):
                yield s["name"], part.clone().view(d).reshape(s["shape"])

    return header["version"], tensors()
