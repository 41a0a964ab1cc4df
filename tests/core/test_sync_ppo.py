"""Tier 2: Core sync PPO end to end (``areal core sync-ppo``'s script under the real local
launcher, a real generation server, the tiny model).

- Core's first step on 2 Ray model workers (actor dp=2, a local Ray instance the master starts)
  + the generation worker (its samples and MFC shares recorded) equals Lite's
  sync GRPO first step (``examples/gsm8k_grpo.py``, ``rollout.max_staleness=0``) with the same
  seed and config: the same rollouts (``gconfig.seed``: seeded per sample), the same loss and
  gradient norm, the same updated weights (1e-5).
- In process: stats per MFC, the actor's weights pushed to the server before each generation
  (the step-2 rollouts are version 1), and a resume from the recover checkpoint continues with
  the version it saved. The same runs record what ``areal view`` shows (``areal.core.record``):
  every trained sample of each step with its server, the generation worker, the trainer's
  logprob and advantage of every token, and each step's MFCs on their workers; the resume keeps
  the first run's records and adds step 3's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))  # launch_harness

from launch_harness import REPO, start_launch, train_steps  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = REPO / "areal" / "core" / "sync_ppo.py"
LITE = REPO / "examples" / "gsm8k_grpo.py"
YAML = REPO / "examples" / "arithmetic_grpo.yaml"
HERE = Path(__file__).resolve().parent
SYNC = [  # 2 prompts x 4 samples x 4 tokens, on-policy, seeded samples, a reward that varies
    "actor.dynamic_sampling=false",
    "train_dataset.batch_size=2",
    "gconfig.n_samples=4",
    "gconfig.max_new_tokens=4",
    "eval_gconfig.max_new_tokens=4",
    "rollout.max_concurrent_rollouts=4",
    "rollout.max_staleness=0",
    "gconfig.seed=11",
    "seed=5",
    "valid_dataset=null",
    "reward_fn=sync_rewards:content_reward",
    "reward.timeout=300",
    # Adam's first step is lr * g / (|g| + eps): with eps=1 it is smooth in g, so summing the
    # gradient in another order (dp=2) moves the weights by ~1e-9, not by lr
    "actor.optimizer.lr=1e-2",
    "actor.optimizer.eps=1.0",
]
ENV = {"PYTHONPATH": str(HERE)}  # sync_rewards, for the trainer and the reward workers


def weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / "actor" / f"step{step}" / "model.safetensors"))


RUN_TIMEOUT = 300.0  # seconds; a run takes ~20-60 s on a quiet 2-core machine


class Runs:
    """Launches under one root; :meth:`cleanup` kills whatever any of them left. With ``head``
    (a :class:`tests.daemons.Daemon`), a Core run's master joins that Ray cluster; without, it
    starts a local instance of its own (RAY_ADDRESS unset: the default a user gets)."""

    def __init__(self, root: Path, head=None):
        self.root, self.head, self.launches = root, head, []

    def start(self, name: str, script: Path, overrides: list[str]):
        """Start ``script`` as experiment ``name`` (trial t): its :class:`Launch`."""
        launch = start_launch(
            script,
            YAML,
            [f"experiment_name={name}", "trial_name=t", *overrides],
            self.root,
            env={**ENV, "RAY_ADDRESS": ""},  # unset unless it joins the head
            cluster=self.head,
        )
        self.launches.append(launch)
        return launch

    def run(self, name: str, script: Path, overrides: list[str]) -> Path:
        """Run ``script`` to the end as experiment ``name``; assert exit 0 and no survivors."""
        launch = self.start(name, script, overrides)
        code = launch.wait(RUN_TIMEOUT)
        run_dir = self.root / name / "t"
        log = run_dir / "logs" / "trainer.log"
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
        assert code == 0, f"{name} exited with {code}:\n{launch.output()}\n{tail}"
        launch.assert_no_survivors()
        return run_dir

    def cleanup(self) -> None:
        for launch in self.launches:
            launch.cleanup()


@pytest.fixture
def runs(tmp_path):
    made = Runs(tmp_path)
    yield made
    made.cleanup()


@pytest.fixture
def cluster_runs(tmp_path, ray_head):
    """Runs whose Core masters join the session's Ray cluster (tests/conftest.py ray_head)."""
    made = Runs(tmp_path, ray_head)
    yield made
    made.cleanup()


def test_core_sync_ppo_first_step_on_ray_equals_lite_sync_grpo(runs, tiny_model_dir, monkeypatch):
    # no address: the master starts a local Ray instance (loopback, sized for the workers) under
    # torchrun, whose variables its workers must not take for their own rendezvous; it goes
    # away with the run (no survivors)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    common = [f"actor.path={tiny_model_dir}", *SYNC, "total_train_steps=1"]
    lite = runs.run("lite", LITE, common)
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    core = runs.run("core", SCRIPT, [*common, "core.backend=ray", "core.n_workers=2"])
    assert token.exists() == had_token, "the local Ray instance wrote ~/.ray/auth_token"
    lite_stats, core_stats = train_steps(lite)[1], train_steps(core)[1]
    assert (
        core_stats["mfc/actor_train/n_tokens"] == lite_stats["perf/n_tokens"]
    )  # the same rollouts
    for key in ("reward/mean", "perf/n_tokens", "perf/n_trained_tokens"):
        assert core_stats[key] == lite_stats[key], key
    assert lite_stats["loss/grad_norm"] > 0  # the step did something to compare
    for key in ("loss/loss", "loss/grad_norm", "loss/entropy"):  # dp=2 sums in another order
        assert core_stats[key] == pytest.approx(lite_stats[key], rel=1e-5, abs=1e-6), key
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    lite_w, core_w = weights(lite, 1), weights(core, 1)
    assert max(float((lite_w[k] - start[k]).abs().max()) for k in start) > 1e-6
    gap = max(float((lite_w[k] - core_w[k]).abs().max()) for k in lite_w)
    assert gap < 1e-5, f"Core's step-1 weights differ from Lite's by {gap}"
    # recorded for areal view: the kept fields read from both dp ranks, each MFC's shares
    rows = pq.read_table(core / "samples" / "step-000001-rank0.parquet").to_pylist()
    assert len(rows) == 8 and {r["worker"] for r in rows} == {"worker2"}
    assert all(len(r["trainer_logp"]) == len(r["advantages"]) == r["length"] for r in rows)
    (line,) = (core / "timeline.jsonl").read_text().splitlines()
    spans = {(s["name"], s["worker"]) for s in json.loads(line)["spans"] if s["kind"] == "mfc"}
    assert spans == {
        ("actor_gen", 2),
        *((m, w) for m in ("actor_adv", "actor_train") for w in (0, 1)),
    }


def assert_recorded(run_dir: Path, steps: list[int]) -> None:
    """RUN_DIR holds the samples and timeline of ``steps``: every trained sample of each (2
    prompts x 4) from the generation worker (worker 1) on the step's version (staleness 0), with
    the trainer's logprob and advantage per token; actor_gen (after its server push) on worker 1,
    actor_adv and actor_train on worker 0."""
    files = sorted((run_dir / "samples").glob("*.parquet"))
    assert [f.name for f in files] == [f"step-{s:06d}-rank0.parquet" for s in steps]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert [r["step"] for r in rows] == [s for s in steps for _ in range(8)]
    for r in rows:
        assert r["worker"] == "worker1" and re.fullmatch(r"[\w.-]+:\d+", r["server"]), r
        assert r["trainer_version"] == r["step"] - 1 and r["staleness"] == 0
        assert r["versions"] == [r["step"] - 1] * r["length"]
        assert len(r["trainer_logp"]) == len(r["advantages"]) == len(r["behav_logp"]) == r["length"]
    assert any(a != 0 for r in rows for a in r["advantages"])  # the reward varies
    gap = max(abs(t - b) for r in rows for t, b in zip(r["trainer_logp"], r["behav_logp"]))
    assert gap < 1e-3  # the server's and the trainer's logprob under the same weights
    timeline = [json.loads(ln) for ln in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timeline] == steps
    for t in timeline:
        spans = [(s["kind"], s["name"], s["worker"]) for s in t["spans"]]
        assert spans == [("hook", "update_servers actor@0", 1), ("mfc", "actor_gen", 1),
                         ("mfc", "actor_adv", 0), ("mfc", "actor_train", 0)]  # fmt: skip
        assert all(0 <= s["queued"] <= s["start"] <= s["end"] <= t["seconds"] for s in t["spans"])


def test_core_sync_ppo_pushes_weights_each_step_and_resumes_with_its_version(runs, tiny_model_dir):
    common = [f"actor.path={tiny_model_dir}", *SYNC, "recover.mode=auto", "recover.freq_steps=1"]
    common.append("stats_logger.samples.enabled=true")  # areal view's samples and timeline
    first = runs.run("resume", SCRIPT, [*common, "total_train_steps=2"])
    assert_recorded(first, [1, 2])
    steps = train_steps(first)
    assert (
        steps[1]["staleness/version_share/0"] == 1.0
        and steps[2]["staleness/version_share/1"] == 1.0
    )
    for name in ("actor_gen", "actor_adv", "actor_train"):
        assert steps[2][f"mfc/{name}/wall_time"] > 0 and steps[2][f"mfc/{name}/n_tokens"] > 0
    assert "mfc/actor_logp/wall_time" not in steps[2]  # one minibatch: no proximal-logp node
    again = runs.run("resume", SCRIPT, [*common, "total_train_steps=3"])
    assert again == first
    records = [r for r in train_steps(again).values()]
    assert sorted(r["step"] for r in records) == [1, 2, 3]
    assert train_steps(again)[3]["staleness/version_share/2"] == 1.0  # resumed at version 2
    log = (again / "logs" / "trainer.log").read_text(errors="replace")
    assert "resum" in log.lower()
    assert_recorded(again, [1, 2, 3])


def test_core_sync_ppo_refuses_an_async_staleness_and_replay_before_starting(
    tmp_path, tiny_model_dir
):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "core",
            "sync-ppo",
            "--config",
            str(YAML),
            f"actor.path={tiny_model_dir}",
            f"fileroot={tmp_path}",
            "rollout.max_staleness=2",
            "stats_logger.replay.enabled=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    assert (
        "rollout.max_staleness: 2; sync PPO generates every batch with the current weights"
        in out.stderr
    )
    assert (
        "stats_logger.replay.enabled: true; areal replay replays Lite runs and Core async PPO, "
        "not Core sync PPO" in out.stderr
    )
