"""Tier 2: what a Core async PPO run records (``areal core async-ppo``'s script under the real
local launcher, one model worker on Ray, 2 rollout workers, the tiny model, 2 steps with
``rollout.max_staleness=1``) and its replay.

- samples (``areal view``): every trained sample of both steps, with the server and the rollout
  worker it came from, the trainer's logprob and the advantage of every token;
- the MFC timeline: each step's actor_adv and actor_train on model worker 0, in order;
- ``areal replay``: the async PPO graph re-run in one process on the recorded batches gives the
  run's weights bit for bit after every step; another learning rate first differs at step 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the Core tests' helpers

from test_async_ppo import ASYNC, SCRIPT  # noqa: E402
from test_sync_ppo import ENV, runs  # noqa: E402,F401  (runs: the fixture)

pytestmark = pytest.mark.slow
RECORDED = [
    *ASYNC, "core.n_workers=1", "total_train_steps=2", "rollout.max_staleness=1", "seed=3",
    "stats_logger.replay.enabled=true", "stats_logger.replay.keep_weights=true",
]  # fmt: skip


def _replay(run_dir: Path, *knobs: str, to: int | None = None) -> subprocess.CompletedProcess:
    """``areal replay [--to STEP] RUN_DIR [KEY=VALUE ...]``"""
    to_args = ["--to", str(to)] if to is not None else []
    return subprocess.run(
        [sys.executable, "-m", "areal.cli", "replay", *to_args, str(run_dir), *knobs],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, **ENV},
    )


def test_core_async_run_records_samples_and_timeline_and_replays_bit_for_bit(
    runs, tiny_model_dir, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = runs.run("rec", SCRIPT, [f"actor.path={tiny_model_dir}", *RECORDED])

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

    timeline = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timeline] == [1, 2]
    for t in timeline:
        mfcs = [(s["name"], s["worker"]) for s in t["spans"] if s["kind"] == "mfc"]
        assert mfcs == [("actor_adv", 0), ("actor_train", 0)]
        adv, train = (s for s in t["spans"] if s["kind"] == "mfc")
        assert 0 <= adv["queued"] <= adv["start"] <= adv["end"] <= train["end"] <= t["seconds"]

    same = _replay(run)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "matches the record bit for bit at every step (0..2)" in same.stdout
    other = _replay(run, "actor.optimizer.lr=0.05", to=1)
    assert other.returncode == 0, other.stdout + other.stderr
    assert "first differ at step 1" in other.stdout
