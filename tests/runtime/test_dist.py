"""Tier 2: engines run their collectives on their own mesh, never on the default group.

Four gloo ranks host two different models, each on a disjoint 2-rank sub-mesh, training at the
same time; each model's loss trace, HF export and final weights must equal a standalone 2-rank
job's, and its DCP checkpoint must reload exactly on its own sub-mesh. A collective on the wrong
group (the default one, or the other model's) would mix the two models' numbers or hang, and fails
this test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from test_fsdp import (  # noqa: E402
    free_port,
    make_engine,
    n_loss_tokens,
    nll_loss,
    random_batch,
    set_dist_env,
)

from areal.api.config.base import MicroBatchSpec  # noqa: E402
from areal.api.io import SaveLoadMeta  # noqa: E402
from areal.runtime.dist import build_mesh, close_distributed, init_distributed  # noqa: E402
from areal.utils.batch import balance_across_ranks  # noqa: E402
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow
STEPS = 3
SPEC = MicroBatchSpec(max_tokens_per_mb=40)


def _train(path: str, model: int, mesh, out: Path) -> dict:
    """STEPS steps of one model on ``mesh`` (each model sees its own batches), then an HF export
    and a DCP checkpoint reloaded into a fresh engine, all on the mesh's own group."""
    engine = make_engine(path, SPEC, mesh=mesh)
    losses = []
    for step in range(STEPS):
        batch = random_batch(seed=100 * model + step)
        mine = batch.select(balance_across_ranks(batch, mesh.size())[mesh.get_local_rank()])
        losses.append(engine.train_batch(mine, nll_loss, n_loss_tokens)["loss"])
    engine.save(SaveLoadMeta(str(out / "hf"), weight_format="hf"))
    engine.save(SaveLoadMeta(str(out / "dcp"), weight_format="dcp", with_optim=True))
    state = engine.full_state_dict()
    engine.destroy()
    fresh = make_engine(path, SPEC, mesh=mesh)
    fresh.load(SaveLoadMeta(str(out / "dcp"), weight_format="dcp", with_optim=True))
    restored = fresh.full_state_dict()
    fresh.destroy()
    return {"losses": losses, "state": state, "restored": restored}


def _shared_job(rank: int, paths: list[str], port: int, out: str) -> None:
    set_dist_env(rank, 4, port)
    ctx = init_distributed("gloo")
    # ranks 0-1 train model 0, ranks 2-3 model 1, concurrently; every rank builds both meshes
    meshes = [build_mesh("cpu", ranks, dp=2) for ranks in ((0, 1), (2, 3))]
    model, mesh = ctx.rank // 2, meshes[ctx.rank // 2]
    result = _train(paths[model], model, mesh, Path(out) / f"shared{model}")
    if mesh.get_local_rank() == 0:
        torch.save(result, Path(out) / f"shared{model}.pt")
    close_distributed()


def _standalone_jobs(rank: int, paths: list[str], port: int, out: str) -> None:
    set_dist_env(rank, 2, port)
    ctx = init_distributed("gloo")
    for model, path in enumerate(paths):  # one 2-rank run per model, one after the other
        result = _train(path, model, ctx.mesh, Path(out) / f"alone{model}")
        if rank == 0:
            torch.save(result, Path(out) / f"alone{model}.pt")
    close_distributed()


def test_two_models_on_disjoint_sub_meshes_train_as_two_standalone_jobs(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from areal.utils.tiny_model import build_tiny_model

    other = str(build_tiny_model(tmp_path / "other", size="tiny", seed=1))
    paths = [tiny_model_dir, other]
    run_ranks(_shared_job, 4, (paths, free_port(), str(tmp_path)), timeout=300)
    run_ranks(_standalone_jobs, 2, (paths, free_port(), str(tmp_path)), timeout=300)
    finals = []
    for model in range(2):
        shared, alone = (
            torch.load(tmp_path / f"shared{model}.pt"),
            torch.load(tmp_path / f"alone{model}.pt"),
        )
        assert shared["losses"] == pytest.approx(alone["losses"], abs=1e-6)
        assert shared["state"].keys() == alone["state"].keys()
        worst = max(
            (shared["state"][k] - alone["state"][k]).abs().max().item() for k in alone["state"]
        )
        assert worst <= 1e-6, f"model {model}: max parameter difference {worst}"
        exported = load_file(tmp_path / f"shared{model}" / "hf" / "model.safetensors")
        reference = load_file(tmp_path / f"alone{model}" / "hf" / "model.safetensors")
        assert all(torch.allclose(exported[k], reference[k], atol=1e-6) for k in reference)
        assert all(torch.equal(shared["restored"][k], shared["state"][k]) for k in shared["state"])
        finals.append(shared["losses"])
    assert finals[0] != finals[1]  # two different models really trained
