"""The embedded generator's sparse MoE MLP (areal/serving/moe.py) against transformers'
``Qwen3MoeSparseMoeBlock``, and the two spellings of its weights (per expert, fused)."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _hf_block(norm_topk_prob: bool, dtype: torch.dtype, device: str):
    """A random Qwen3-MoE block: 64 wide, 8 experts of width 32, 3 per token."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        block = Qwen3MoeSparseMoeBlock(config)
        for p in block.parameters():  # created empty / zero: a router of zeros routes nothing
            p.data.normal_(0.0, 0.2)
    return config, block.to(device, dtype).eval()


def _served(config, block):
    from areal.serving.families.qwen3_moe import read_experts
    from areal.serving.moe import SparseMoe, per_expert, stack_experts

    # the block's own (transformers 5: fused) names, split per expert, then stacked
    params, problems = per_expert(
        {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    )
    experts = read_experts(config.to_dict())
    stacks = stack_experts(params, experts)
    assert problems == [] and list(stacks) == [0]
    return SparseMoe(params["model.layers.0.mlp.gate.weight"], *stacks[0], experts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sparse_moe_routes_and_sums_experts_as_transformers(norm_topk_prob, dtype, device):
    config, block = _hf_block(norm_topk_prob, dtype, device)
    moe = _served(config, block)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with torch.no_grad():
        _, hf_weights, hf_chosen = block.gate(x)
        weights, chosen = moe.route(x)
        assert torch.equal(chosen, hf_chosen) and torch.equal(weights, hf_weights)
        assert len(set(chosen.flatten().tolist())) == 8  # every expert has tokens
        torch.testing.assert_close(moe(x), block(x[None])[0])
        # rows are independent: a batch of one row gives that row's output
        torch.testing.assert_close(moe(x[5:6]), moe(x)[5:6])


def test_fused_experts_split_into_per_expert_views_and_a_bad_shape_is_named():
    from areal.serving.moe import per_expert

    gate_up = torch.arange(2 * 6 * 3.0).view(2, 6, 3)  # [E=2, 2I=6, H=3]
    down = torch.arange(2 * 3 * 3.0).view(2, 3, 3)  # [E, H, I]
    pre = "model.layers.4.mlp."
    named, problems = per_expert(
        {pre + "experts.gate_up_proj": gate_up, pre + "experts.down_proj": down, "x": down}
    )
    assert problems == [] and named["x"] is down
    assert torch.equal(named[pre + "experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(named[pre + "experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(named[pre + "experts.0.down_proj.weight"], down[0])
    assert named[pre + "experts.1.up_proj.weight"].data_ptr() == gate_up[1, 3:].data_ptr()
    assert len(named) == 7  # 2 experts x 3 projections, and "x"
    _, problems = per_expert({pre + "experts.gate_up_proj": gate_up[:, :5]})
    assert problems == [
        f"{pre}experts.gate_up_proj: shape (2, 5, 3) is not [experts, 2 * width, hidden]"
    ]
