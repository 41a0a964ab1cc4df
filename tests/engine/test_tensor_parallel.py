"""Tensor parallelism (tier 2): FSDPEngine on ("dp", "tp") meshes under gloo on CPU.

A training step (SFT and PPO actor) on dp=1 x tp=2 equals dp=2 x tp=1 and the single-process
step (loss, grad norm, updated full weights; 1e-5), and so do the logprobs; on tp=2, DCP
save/load resumes identically, the HF export holds the full weights, a full state dict loads
into the tp shards (the Core reallocation path), and activation checkpointing changes nothing.
Each layout runs once (a module fixture) and the tests read what it recorded.

dp=2 x tp=2 (4 processes) runs in the suite through Core, on 4 Ray workers shared by the
layouts of tests/core/test_ray_pp.py (a PPO step equal to Lite's, and the weights' placements).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_fsdp import LINEAR_ADAM, free_port, random_batch, set_dist_env, world_mesh
from test_ppo import GROUP, actor_config, rollout_batch

from areal.api.config.base import MicroBatchSpec
from areal.api.config.engine import TrainEngineConfig
from areal.api.io import SaveLoadMeta
from areal.engine.ppo import PPOActor
from areal.engine.sft import SFTEngine
from areal.engine.tensor_parallel import check_tensor_parallel
from areal.utils.batch import balance_across_ranks
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
SFT_MB = MicroBatchSpec(max_tokens_per_mb=30)


def _sft_step(path: str, mesh, **kw) -> dict:
    """One SFT step on this dp rank's share of the batch; then logprobs of the whole batch."""
    engine = SFTEngine(
        TrainEngineConfig(path=path, mb_spec=SFT_MB, optimizer=LINEAR_ADAM, **kw), mesh
    )
    engine.initialize(None)
    batch = random_batch()
    share = batch.select(balance_across_ranks(batch, engine.world_size)[engine.rank])
    _, stats = engine.train_lm(share)
    logp = engine.compute_logp(batch)[0]["logp"]  # [T] every rank passes the whole batch
    state = engine.full_state_dict()
    engine.destroy()
    return {"stats": stats, "state": state, "logp": logp}


def _ppo_step(path: str, mesh) -> dict:
    """One GRPO actor step on this dp rank's share (whole groups) of a rollout batch."""
    actor = PPOActor(actor_config(path, budget=24, lr=1e-2, eps=1.0), mesh, group_size=GROUP)
    actor.initialize(None)
    batch = rollout_batch(n_groups=4)
    share = batch.select(balance_across_ranks(batch, actor.world_size, GROUP)[actor.rank])
    logp = actor.compute_logp(share)[0]["logp"]
    share, _ = actor.compute_advantages(share.with_fields(tokens={"logprobs": logp}))
    _, stats = actor.ppo_update(share)
    state = actor.full_state_dict()
    actor.destroy()
    return {"stats": stats, "state": state}


def _tp_extras(path: str, mesh, tmp: str) -> dict:
    """Checkpoint, export and reallocation paths on a tensor-parallel mesh."""
    from areal.api.mfc import ModelName
    from areal.core import realloc
    from areal.core.dfg import Allocation
    from areal.engine.checkpoint import read_hf_weights

    def build(**kw) -> SFTEngine:
        engine = SFTEngine(
            TrainEngineConfig(path=path, mb_spec=SFT_MB, optimizer=LINEAR_ADAM, **kw), mesh
        )
        engine.initialize(None)
        return engine

    out = {"ckpt": _sft_step(path, mesh, activation_checkpointing="full")}
    a = build()
    a.train_lm(random_batch(seed=1))
    a.set_version(5)
    a.save(SaveLoadMeta(path=f"{tmp}/dcp", weight_format="dcp", with_optim=True))
    a.save(SaveLoadMeta(path=f"{tmp}/hf", weight_format="hf"))
    out["saved"] = a.full_state_dict()
    out["next_a"] = a.train_lm(random_batch(seed=7))[1], a.full_state_dict()
    b = build()
    b.load(SaveLoadMeta(path=f"{tmp}/dcp", weight_format="dcp", with_optim=True))
    out["version_b"] = b.get_version()
    out["next_b"] = b.train_lm(random_batch(seed=7))[1], b.full_state_dict()
    c = build()  # initial weights; every rank takes its pieces of the exported full weights
    own = c.full_state_dict()
    full = read_hf_weights(f"{tmp}/hf", c.hf_config)
    dp, tp = mesh.shape
    layout = Allocation(ModelName("m"), tuple(range(dp * tp)), dp=dp, tp=tp)
    whole = Allocation(ModelName("m"), (-1,))  # one holder of every full tensor
    rank = dist.get_rank()
    pieces = realloc.pieces_for(rank, whole, layout, realloc.engine_shapes(c))
    boxes = [realloc.relative(p.box, tuple((0, n) for n in full[p.name].shape)) for p in pieces]
    tensors = [full[p.name][b] for p, b in zip(pieces, boxes)]
    realloc.write_pieces(c, layout, rank, pieces, tensors, ema=0.5)
    out["ema"] = {"own": own, "after": c.full_state_dict()}
    c.load(SaveLoadMeta(path=f"{tmp}/hf", weight_format="hf"))
    out["hf_loaded"] = c.full_state_dict()
    for engine in (a, b, c):
        engine.destroy()
    return out


def _layout_run(
    rank: int, path: str, port: int, out: str, dp: int, tp: int, tmp: str | None
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    set_dist_env(rank, dp * tp, port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    result = {"sft": _sft_step(path, mesh), "ppo": _ppo_step(path, mesh)}
    if tmp is not None:
        result.update(_tp_extras(path, mesh, tmp))
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def run_layout(path: str, tmp: Path, dp: int, tp: int, extras: bool = False) -> dict:
    out = str(tmp / f"dp{dp}_tp{tp}.pt")
    work = str(tmp / f"work_dp{dp}_tp{tp}") if extras else None
    run_ranks(_layout_run, dp * tp, (path, free_port(), out, dp, tp, work), timeout=240)
    return torch.load(out)


@pytest.fixture(scope="module")
def layouts(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    mesh = world_mesh()  # one process: the plain engine, no tensor parallelism
    return {
        "single": {"sft": _sft_step(tiny_model_dir, mesh), "ppo": _ppo_step(tiny_model_dir, mesh)},
        "dp1_tp2": run_layout(tiny_model_dir, tmp, 1, 2, extras=True),
        "dp2_tp1": run_layout(tiny_model_dir, tmp, 2, 1),
        "hf_dir": tmp / "work_dp1_tp2" / "hf",
    }


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", ["sft", "ppo"])
@pytest.mark.parametrize("other", ["single", "dp2_tp1"])
def test_training_step_on_tp2_equals_dp2_and_one_process(layouts, kind, other):
    tp, ref = layouts["dp1_tp2"][kind], layouts[other][kind]
    assert tp["stats"]["loss"] == pytest.approx(ref["stats"]["loss"], abs=1e-5)
    assert tp["stats"]["grad_norm"] == pytest.approx(ref["stats"]["grad_norm"], rel=1e-5)
    assert tp["stats"]["grad_norm"] > 0
    assert max_diff(tp["state"], ref["state"]) < 1e-5


def test_logprobs_on_tp2_equal_the_single_process_logprobs(layouts):
    tp, single = layouts["dp1_tp2"]["sft"]["logp"], layouts["single"]["sft"]["logp"]
    assert tp.shape == single.shape == (random_batch().n_tokens,)
    assert (tp - single).abs().max().item() < 1e-5


def test_activation_checkpointing_on_tp2_gives_the_same_step(layouts):
    plain, ckpt = layouts["dp1_tp2"]["sft"], layouts["dp1_tp2"]["ckpt"]
    assert ckpt["stats"]["loss"] == pytest.approx(plain["stats"]["loss"], abs=1e-6)
    assert max_diff(ckpt["state"], plain["state"]) < 1e-6


def test_dcp_round_trip_on_tp2_resumes_identically(layouts):
    run = layouts["dp1_tp2"]
    (stats_a, state_a), (stats_b, state_b) = run["next_a"], run["next_b"]
    assert run["version_b"] == 5
    assert stats_b["loss"] == stats_a["loss"] and stats_b["grad_norm"] == stats_a["grad_norm"]
    assert max_diff(state_a, state_b) == 0.0


def test_full_state_dict_and_hf_export_on_tp2_hold_full_tensors(layouts):
    from transformers import AutoConfig

    from areal.engine.checkpoint import read_hf_weights

    run = layouts["dp1_tp2"]
    single = layouts["single"]["sft"]["state"]
    assert {k: v.shape for k, v in run["saved"].items()} == {k: v.shape for k, v in single.items()}
    assert max_diff(run["hf_loaded"], run["saved"]) == 0.0
    hf_dir = layouts["hf_dir"]
    exported = read_hf_weights(str(hf_dir), AutoConfig.from_pretrained(hf_dir))
    assert max_diff(exported, run["saved"]) == 0.0


def test_full_state_loads_into_tp2_shards_with_ema(layouts):
    run = layouts["dp1_tp2"]
    own, after, src = run["ema"]["own"], run["ema"]["after"], run["saved"]
    expected = {k: 0.5 * own[k] + 0.5 * src[k] for k in own}
    assert max_diff(after, expected) < 1e-6 and max_diff(own, src) > 1e-4


def test_unsupported_architectures_and_indivisible_sizes_are_refused():
    from transformers import Qwen2Config, Qwen3Config

    with pytest.raises(ValueError, match="model types .* got 'qwen3'; use tp=1"):
        check_tensor_parallel(Qwen3Config(), 2)
    config = Qwen2Config(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=768, hidden_size=256
    )
    check_tensor_parallel(config, 2)
    with pytest.raises(
        ValueError, match="qwen2 model: num_key_value_heads=2 not divisible by tp=4"
    ):
        check_tensor_parallel(config, 4)


def test_a_mesh_without_dp_tp_names_is_refused(tiny_model_dir):
    from torch.distributed.device_mesh import init_device_mesh

    world_mesh()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"2-D mesh named \('dp', 'tp'\), got 2-D .* \('a', 'b'\)"):
        SFTEngine(TrainEngineConfig(path=tiny_model_dir), mesh)
