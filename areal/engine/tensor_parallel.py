"""Tensor parallelism (Megatron-style) for the Hugging Face Qwen2 / Llama decoder family.

:func:`apply_tensor_parallel` turns a model's parameters into DTensors on a 1-D ``tp`` mesh;
:class:`~areal.engine.fsdp.FSDPEngine` then shards them over ``dp`` with ``fully_shard``
(FSDP2 composes with DTensor parameters into ``(dp, tp)`` 2-D DTensors).

The plan, per decoder layer (``torch.distributed.tensor.parallel.parallelize_module``):

- attention: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel (each rank computes
  ``num_attention_heads / tp`` query heads and ``num_key_value_heads / tp`` key/value heads,
  biases sharded with them), ``o_proj`` row-parallel (one all-reduce). The HF attention reshapes
  with ``view(..., -1, head_dim)``, so it runs on the local heads as they come; the grouped-query
  ratio ``num_key_value_groups`` is unchanged because both head counts are divided by ``tp``.
- MLP: ``gate_proj``, ``up_proj`` column-parallel, ``down_proj`` row-parallel (one all-reduce).
- Outputs are plain local tensors (``use_local_output=True``); no sequence parallelism.

Every other parameter (token embedding, RMSNorms, ``lm_head``, a value head's ``score``) is
*replicated* on the tp mesh: a DTensor with ``Replicate()``, whose module takes and returns plain
tensors. That is the simplest correct choice: each tp rank computes the full embedding, norms and
logits, so the logits ``[T, V]`` come out whole on every rank for the losses and logprob hooks,
with no vocabulary-parallel cross-entropy. It costs the memory of the embedding and head on each
tp rank (FSDP still shards them over ``dp``). The backward stays exact: a column-parallel
layer's input gradient is all-reduced over tp on its way back into the replicated activations.
Tied weights (``tie_word_embeddings``) stay one parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from areal.engine.pipeline import decoder_layers

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")  # attention without per-head norms (Qwen3 has q/k norms)

LAYER_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def check_tensor_parallel(hf_config: Any, tp: int) -> None:
    """Raise ``ValueError`` naming the model type, the field and the fix when ``hf_config``
    cannot be split over ``tp`` ranks with :data:`LAYER_PLAN`."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism (tp={tp}) supports model types {list(SUPPORTED_MODEL_TYPES)}, "
            f"got {model_type!r}; use tp=1 for this model"
        )
    heads = hf_config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(
            f"{model_type} model: {', '.join(bad)} not divisible by tp={tp}; "
            f"choose a tp that divides {sorted(set(sizes.values()))}"
        )


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` (see the module docstring)."""
    check_tensor_parallel(model.config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):  # a pipeline stage's own layers, or all
        parallelize_module(
            layer, tp_mesh, {name: styles[kind]() for name, kind in LAYER_PLAN.items()}
        )
    replicate_remaining(model, tp_mesh)


def replicate_remaining(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Make every parameter that is not yet a DTensor a ``Replicate()`` DTensor on ``mesh``;
    each module owning one gets plain tensors in and out (hooks convert). A parameter shared
    by several modules (tied embeddings) becomes one DTensor parameter shared the same way."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        owned = [
            (k, p) for k, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)
        ]
        for key, param in owned:
            if id(param) not in done:
                full = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=None)
                done[id(param)] = torch.nn.Parameter(full, requires_grad=param.requires_grad)
            module.register_parameter(key, done[id(param)])
        if owned:
            module.register_forward_pre_hook(_replicated_inputs(mesh), with_kwargs=True)
            module.register_forward_hook(_local_outputs)


def _replicated_inputs(mesh: DeviceMesh):
    def to_dtensor(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    def hook(module, args, kwargs):
        return tuple(to_dtensor(a) for a in args), {k: to_dtensor(v) for k, v in kwargs.items()}

    return hook


def _local_outputs(module, args, output):
    if isinstance(output, DTensor):
        return output.to_local()
    return output
