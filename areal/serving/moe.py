"""The sparse MoE MLP of the embedded generator (Qwen3-MoE), and the two spellings of its weights.

Computed as transformers' ``Qwen3MoeSparseMoeBlock``: router logits in the model's dtype, their
softmax in fp32, the top-k experts, with ``norm_topk_prob`` their probabilities renormalised to
sum to 1, cast back to the model's dtype; each chosen expert's SwiGLU output times its weight,
summed over the experts in ascending order into zeros (the same order of additions).

Dispatch: the ``[T * k]`` (token, expert) pairs are sorted by expert once; then each expert with
tokens runs one gather, its two matmuls and one ``index_add_`` over exactly its tokens. A loop
over experts, never over tokens, with one host sync a layer (the tokens per expert). A token
picks an expert at most once, so no ``index_add_`` writes a row twice: deterministic on CUDA
too. (torch's grouped matmul, ``torch._grouped_mm``, is private and CUDA-only, so not used.)

Weight names: HF's files hold each expert's projections (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``: what ``save_pretrained`` writes); transformers 5's modules, hence the
trainer's state dict and its weight updates, hold them fused per layer
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``). The server keeps
one stacked copy a layer, its per-expert names views into it (:func:`stack_experts`), and splits
fused tensors into those names (:func:`per_expert`): either spelling loads and updates in place.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from areal.serving.families.base import Experts

# transformers 5's fused expert weights: (the layer's "model.layers.{i}.mlp." prefix, which)
FUSED = re.compile(r"^(.*\.mlp\.)experts\.(gate_up_proj|down_proj)$")


def expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    """HF's names of expert ``e``'s gate, up and down projections in the layer whose MLP names
    start with ``prefix`` (``model.layers.{i}.mlp.``)."""
    gate, up, down = (f"{prefix}experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down"))
    return gate, up, down


def per_expert(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``named`` with each fused expert tensor split into HF's per-expert names (views, no
    copy), and a problem for each fused tensor that does not split (not 3-D; an odd
    ``gate_up_proj`` width). Other names pass through."""
    out: dict[str, torch.Tensor] = {}
    problems = []
    for name, t in named.items():
        m = FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, which = m[1], m[2]
        if t.dim() != 3 or (which == "gate_up_proj" and t.shape[1] % 2):
            expected = "[experts, 2 * width, hidden]" if which == "gate_up_proj" else "3-D"
            problems.append(f"{name}: shape {tuple(t.shape)} is not {expected}")
            continue
        half = t.shape[1] // 2
        for e in range(t.shape[0]):
            gate, up, down = expert_names(prefix, e)
            if which == "down_proj":
                out[down] = t[e]
            else:
                out[gate], out[up] = t[e, :half], t[e, half:]
    return out, problems


def stack_experts(
    params: dict[str, torch.Tensor], experts: Experts | None
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each sparse layer's experts stacked: ``{layer: (gate_up [E, 2I, H], down [E, H, I])}``
    (``{}`` for a dense model), ``params``' per-expert entries made views into the stacks: one
    copy of the weights, and an in-place update of a per-expert name reaches the stacks."""
    if experts is None:
        return {}
    return {
        i: _stack_layer(params, f"model.layers.{i}.mlp.", experts.n_experts)
        for i in sorted(experts.sparse_layers)
    }


def _stack_layer(params: dict[str, torch.Tensor], prefix: str, n_experts: int):
    names = [expert_names(prefix, e) for e in range(n_experts)]
    gate_up = torch.stack([torch.cat([params[gate], params[up]]) for gate, up, _ in names])
    down = torch.stack([params[d] for _, _, d in names])
    width = gate_up.shape[1] // 2
    for e, (gate, up, d) in enumerate(names):
        params[gate], params[up], params[d] = gate_up[e, :width], gate_up[e, width:], down[e]
    return gate_up, down


class SparseMoe:
    """One sparse layer's MLP over its router ``[E, H]`` and its stacked experts
    (:func:`stack_experts`): ``x [T, H]`` (post-norm hidden states) -> ``[T, H]``."""

    def __init__(
        self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: Experts
    ):
        self.router, self.gate_up, self.down = router, gate_up, down
        self.experts = experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights ``[T, k]`` (x's dtype) and chosen experts ``[T, k]``
        (most probable first), as transformers' ``Qwen3MoeTopKRouter``."""
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.experts.top_k, dim=-1)
        if self.experts.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        k = chosen.shape[1]
        flat = chosen.flatten()  # [T * k]: token t's j-th expert at t * k + j
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending in each
        counts = torch.bincount(flat, minlength=self.experts.n_experts).tolist()  # host sync
        tokens, pair_weights = order // k, weights.flatten()[order]  # [T * k] each
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                gate, up = F.linear(x.index_select(0, rows), self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down[e])  # [n, H]
                out.index_add_(0, rows, y * pair_weights[start : start + n, None])
            start += n
        return out
