"""Tier 2: what a Core async PPO run records, and its replay (the session's recorded run,
``core_async_recorded``: ``areal core async-ppo``'s script under the real local launcher, one
model worker on Ray, 2 rollout workers, the tiny model, 2 steps with ``rollout.max_staleness=1``).

- samples (``areal view``): every trained sample of both steps, with the server and the rollout
  worker it came from, the trainer's logprob and the advantage of every token;
- the MFC timeline: each step's actor_adv then actor_train on model worker 0;
- ``areal replay``: the async PPO graph re-run in one process on the recorded batches gives the
  run's weights bit for bit after every step; another learning rate first differs at step 1.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import CORE_ENV, replay

pytestmark = pytest.mark.slow


def test_core_run_records_samples_with_their_sources_and_trainer_logp(core_async_recorded):
    run = core_async_recorded
    files = sorted((run / "samples").glob("*.parquet"))
    assert [f.name for f in files] == ["step-000001-rank0.parquet", "step-000002-rank0.parquet"]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 16  # 2 steps x 2 prompts x 4 samples
    servers = json.loads((run / "core_status.json").read_text())["servers"]
    for r in rows:
        assert r["server"] in servers and r["worker"] in ("worker0", "worker1")
        n = r["length"]
        assert len(r["trainer_logp"]) == len(r["advantages"]) == len(r["versions"]) == n
        assert 0 <= r["staleness"] <= 1
    assert any(a != 0 for r in rows for a in r["advantages"])  # the reward varies
    # the trainer's and the server's logprob of a token sampled by the weights it trains on
    fresh = [
        abs(t - b)
        for r in rows
        for t, b, v in zip(r["trainer_logp"], r["behav_logp"], r["versions"])
        if v == r["trainer_version"]
    ]
    assert fresh and max(fresh) < 1e-3


def test_core_run_records_each_steps_mfcs_per_worker(core_async_recorded):
    lines = (core_async_recorded / "timeline.jsonl").read_text().splitlines()
    timeline = [json.loads(line) for line in lines]
    assert [t["step"] for t in timeline] == [1, 2]
    for t in timeline:
        mfcs = [s for s in t["spans"] if s["kind"] == "mfc"]
        assert [(s["name"], s["worker"]) for s in mfcs] == [("actor_adv", 0), ("actor_train", 0)]
        adv, train = mfcs
        assert 0 <= adv["queued"] <= adv["start"] <= adv["end"] <= train["end"] <= t["seconds"]


def test_core_replay_matches_every_step_and_a_changed_lr_diverges_at_step_1(core_async_recorded):
    same = replay(core_async_recorded, CORE_ENV)
    assert same.returncode == 0, same.stdout + same.stderr
    for step in (0, 1, 2):
        assert f"step {step}: weights bit-identical" in same.stdout
    other = replay(core_async_recorded, CORE_ENV, "actor.optimizer.lr=0.05", to=1)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "first differ at step 1" in other.stdout and "max |diff| " in other.stdout
