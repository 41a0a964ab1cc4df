"""A Tinker training model: our FSDP engine with the API's split of a step into
``forward_backward`` calls (gradients add up) and one ``optim_step`` (Adam with the client's
hyper-parameters of that step).

The engine's own ``train_batch`` fuses the two; here the micro-batch forward
(``FSDPEngine._logits``) and the split (``_split``) are the engine's, the loss is the API's
(:mod:`areal.tinker.losses`) and the optimizer is the engine's AdamW, its hyper-parameters set
per step. State: ``save_state`` is the engine's DCP checkpoint (adapters, AdamW moments and
step, version), ``save_weights_for_sampler`` its HF export (the merged model, plus the adapter
alone in peft's layout), which the generator loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import LoRAConfig, TrainEngineConfig
from areal.api.io import SaveLoadMeta
from areal.engine.fsdp import FSDPEngine
from areal.tinker.losses import elementwise_loss, target_logprobs
from areal.tinker.wire import Datum
from areal.utils.batch import PackedBatch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]


@dataclass(frozen=True)
class ModelSpec:
    """What a training model is made of: the base dir, LoRA rank and targets, init seed."""

    base_dir: str
    rank: int
    alpha: float
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    dtype: str = "float32"
    max_tokens_per_mb: int = 8192

    def targets(self) -> list[str]:
        """peft target modules of the linears the client asked to train."""
        return [
            *(ATTN if self.train_attn else []),
            *(MLP if self.train_mlp else []),
            *(UNEMBED if self.train_unembed else []),
        ]

    def engine_config(self) -> TrainEngineConfig:
        """The FSDP engine config of this model (constant LR: each optim_step sets its own)."""
        return TrainEngineConfig(
            path=self.base_dir,
            dtype=self.dtype,  # pyright: ignore[reportArgumentType]  # checked by the service config
            init_seed=self.seed,
            mb_spec=MicroBatchSpec(max_tokens_per_mb=self.max_tokens_per_mb),
            optimizer=OptimizerConfig(lr=1e-4, weight_decay=0.0, gradient_clipping=0.0),
            lora=LoRAConfig(rank=self.rank, alpha=self.alpha, target_modules=self.targets()),
        )


def pack(data: list[Datum]) -> PackedBatch:
    """The datums as one packed batch: ``input_ids`` and each loss input as token fields."""
    lens = torch.tensor([len(d.tokens) for d in data], dtype=torch.long)
    cu = torch.zeros(len(data) + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)
    tokens = {"input_ids": torch.from_numpy(np.concatenate([d.tokens for d in data]))}
    for name in data[0].inputs:
        dtype = torch.long if name == "target_tokens" else torch.float32
        arrays = [np.asarray(d.inputs[name]) for d in data]
        tokens[name] = torch.from_numpy(np.concatenate(arrays)).to(dtype)
    return PackedBatch(cu, tokens)


class TinkerModel(FSDPEngine):
    """An LM engine driven by the Tinker API's calls (see the module docstring)."""

    def __init__(self, spec: ModelSpec, mesh: DeviceMesh):
        super().__init__(spec.engine_config(), mesh, head="lm")
        self.tinker_spec = spec

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, float], forward_only: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum ``logprobs`` and ``elementwise_loss`` [N]; ``loss:sum`` over the request.
        Gradients of the loss add to those of earlier calls since the last :meth:`optim_step`."""
        batch = pack(data)
        self.model.train(not forward_only)
        mbs, n_run = self._split(batch)
        per_seq: list[list[tuple[np.ndarray, np.ndarray]]] = []
        total = 0.0
        for i in range(n_run):
            real = i < len(mbs.mbs)
            mb = mbs.mbs[i if real else 0].to(self.device)
            with torch.set_grad_enabled(not forward_only):
                logits = self._logits(mb)  # [T, V] fp32
                logp = target_logprobs(logits, mb["target_tokens"], self.config.logprob_chunk_size)
                inputs = {k: mb[k] for k in mb.tokens if k not in ("input_ids", "target_tokens")}
                elem = elementwise_loss(loss_fn, logp, inputs, config)  # [T]
                loss = elem.sum() * (1.0 if real else 0.0)  # a padding run adds nothing
                if not forward_only:
                    loss.backward()
            if real:
                total += float(loss.detach())
                lens = mb.seqlens.tolist()
                lp = logp.detach().cpu().numpy().astype(np.float32)
                el = elem.detach().cpu().numpy().astype(np.float32)
                per_seq.append(
                    list(
                        zip(np.split(lp, np.cumsum(lens)[:-1]), np.split(el, np.cumsum(lens)[:-1]))
                    )
                )
        ordered = mbs.restore_order(per_seq)
        outputs = [{"logprobs": lp, "elementwise_loss": el} for lp, el in ordered]
        return outputs, {"loss:sum": total}

    def optim_step(
        self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, clip: float
    ) -> dict[str, float]:
        """One AdamW step on the gradients accumulated so far, with these hyper-parameters;
        a non-finite gradient norm skips the update (gradients are dropped either way)."""
        assert self.optimizer is not None  # initialize() built it
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        finite = bool(torch.isfinite(norm))
        if finite:
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.version += 1
        return {"grad_norm:mean": float(norm), "update_skipped:sum": float(not finite)}

    def save_state(self, path: str, optimizer: bool = True) -> None:
        """DCP checkpoint of the adapters (and with ``optimizer`` AdamW's state) at ``path``."""
        self.save(SaveLoadMeta(path, weight_format="dcp", with_optim=optimizer))

    def load_state(self, path: str, optimizer: bool) -> None:
        """Load a :meth:`save_state` checkpoint; ``optimizer`` restores AdamW's state too."""
        self.load(SaveLoadMeta(path, weight_format="dcp", with_optim=optimizer))

    def export_for_sampler(self, path: str) -> None:
        """HF export of the merged model at ``path`` (what the generator loads)."""
        self.save(SaveLoadMeta(path, weight_format="hf"))
