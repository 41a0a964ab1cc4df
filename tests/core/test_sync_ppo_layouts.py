"""Tier 2: ``areal core sync-ppo`` with a non-default layout (the real launcher, a generation
server, 2 Ray model workers, the tiny model): the actor trains on pp=2 (two pipeline stages) and
its proximal-logp MFC runs on dp=2 (``core.layouts``), so each step moves the trained weights to
the dp=2 replica first; the run's stats log that move's bytes (exactly the plan ``areal core graph``
prints) and seconds at every step."""

from __future__ import annotations

import pytest
from test_sync_ppo import SCRIPT, SYNC, cluster_runs, train_steps  # noqa: F401 - fixture

from areal.api.mfc import ModelName
from areal.core.dfg import Allocation
from areal.core.realloc import model_shapes, plan_realloc

pytestmark = pytest.mark.slow

LAYOUT = [
    "core.backend=ray",
    "core.n_workers=2",
    "core.allocations=[{model: actor, workers: [0, 1], pp: 2}]",
    "core.layouts=[{mfc: actor_logp, dp: 2}]",
    "actor.ppo_n_minibatches=2",  # a proximal-logp MFC (decoupled loss, two minibatches)
    "total_train_steps=2",
]


def test_sync_ppo_with_the_actor_logp_on_another_layout_logs_each_reallocation(
    cluster_runs, tiny_model_dir
):
    run_dir = cluster_runs.run("layouts", SCRIPT, [f"actor.path={tiny_model_dir}", *SYNC, *LAYOUT])
    steps = train_steps(run_dir)
    actor, replica = ModelName("actor"), ModelName("actor", 1)
    plan = plan_realloc(
        Allocation(actor, (0, 1), pp=2),
        Allocation(replica, (0, 1), dp=2),
        model_shapes(tiny_model_dir),
    )
    assert sorted(steps) == [1, 2]
    for step in (1, 2):  # step 1: the replica's first weights; step 2: after the update
        assert steps[step]["realloc/actor@1/bytes"] == plan.moved > 0
        assert steps[step]["realloc/actor@1/seconds"] > 0
        assert steps[step]["mfc/actor_logp/n_tokens"] == steps[step]["mfc/actor_train/n_tokens"]
    assert steps[1]["loss/grad_norm"] > 0  # step 2's move carries changed weights
