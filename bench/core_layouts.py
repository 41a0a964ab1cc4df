"""Core sync PPO with the actor's inference on another layout than its training: does it learn
like the plain layout? Held-out gain, wall time, reallocation bytes and seconds, per seed.

Run (after ``make demo``, whose SFT checkpoint every run starts from):
``python bench/core_layouts.py [--steps 50] [--seeds 1 2 3] [--sft DIR] [--out DIR]``; or, from
any model (e.g. ``areal tiny-model``'s, untrained), ``--quick --sft DIR --steps 8``: the share of
digits in the answer as the reward (:mod:`layout_rewards`), which GRPO raises from ~0 to ~0.9 in
12 steps, 4 prompts a step, lr 1e-3; its held-out figure is the sampled share (4 answers a
prompt, seeded like the rollouts).

Both sides train ``examples/arithmetic_grpo.yaml`` (two-digit addition, 8 prompts x 8 samples a
step) through ``areal core sync-ppo`` on 2 Ray model workers and one generation server, with two
PPO minibatches so the graph has its proximal-logp MFC (``actor_logp``, the inference pass):

- plain: the actor trains and infers on one layout, ``--train`` (pp=2 on workers 0, 1: two
  pipeline stages);
- layouts: the actor trains on the same layout and ``actor_logp`` runs on ``--infer`` (dp=2 on
  workers 0, 1): before each inference the trained weights move to the dp=2 replica
  (``core.layouts``; ``realloc/actor@1/{bytes,seconds}`` in the stats).

The two sides differ only in where the proximal logprobs are computed (and the weight move
before it): with the same seed the rollouts are the same (``gconfig.seed``) for as long as the
weights agree, so the curves should agree step by step up to floating-point noise, which the
script reports (the largest per-step difference of reward, loss and grad norm, and the first
step whose rollouts differ). Held-out greedy accuracy (200 problems) comes from each run's
step-0 and final evaluation. Prints per seed each side's gain, wall time and the move's bytes
and mean seconds, then the mean difference of gains with its standard error; writes
``OUT/core_layouts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, _default_sft, _run  # noqa: E402

CURVE = ("reward/mean", "loss/loss", "loss/grad_norm", "perf/n_tokens")  # compared step by step
TRAIN = "{model: actor, workers: [0, 1], pp: 2}"
QUICK = (  # --quick: a reward the untrained tiny model learns in ~10 steps (layout_rewards.py)
    "reward_fn=layout_rewards:digit_share", "actor.dynamic_sampling=false",
    "actor.optimizer.lr=1e-3", "train_dataset.batch_size=4",
    # held-out: the sampled digit share (4 answers a prompt; greedy answers turn all-digit early)
    "eval_gconfig.greedy=false", "eval_gconfig.n_samples=4",
)  # fmt: skip
INFER = "{mfc: actor_logp, dp: 2}"


def _stats(run_dir: Path) -> list[dict]:
    lines = (run_dir / "stats.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summarize(run_dir: Path, wall: float) -> dict:
    """Held-out accuracy before/after, wall seconds, and the per-step reallocation figures."""
    rows = _stats(run_dir)
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        raise RuntimeError(f"{run_dir}: no step-0 and final evaluation in stats.jsonl")
    moves = [r for r in rows if "realloc/actor@1/bytes" in r]
    steps = [r["timing/step"] for r in rows if "timing/step" in r]
    out = {
        "acc_before": evals[0]["eval/accuracy"],
        "acc_after": evals[-1]["eval/accuracy"],
        "wall_seconds": wall,
        "step_seconds_mean": statistics.mean(steps) if steps else float("nan"),
    }
    out["gain"] = out["acc_after"] - out["acc_before"]
    out["curve"] = {r["step"]: {k: r[k] for k in CURVE if k in r} for r in rows if "step" in r}
    if moves:
        out["realloc_bytes_per_step"] = statistics.mean(r["realloc/actor@1/bytes"] for r in moves)
        out["realloc_seconds_mean"] = statistics.mean(r["realloc/actor@1/seconds"] for r in moves)
    return out


def curve_gap(plain: dict, layouts: dict) -> dict:
    """Per stat of :data:`CURVE`, the largest step-by-step difference of the two runs, and the
    first step whose batch differs (its token count: the rollouts diverged)."""
    steps = sorted(set(plain) & set(layouts))
    gap: dict = {
        k: max((abs(layouts[s][k] - plain[s][k]) for s in steps if k in plain[s]), default=None)
        for k in CURVE
    }
    differ = [s for s in steps if plain[s].get("perf/n_tokens") != layouts[s].get("perf/n_tokens")]
    gap["first_step_with_other_rollouts"] = differ[0] if differ else None
    return gap


def run_side(side: str, seed: int, args, sft: Path, out: Path) -> dict:
    """One ``areal core sync-ppo`` run of ``side`` (plain or layouts) at ``seed``."""
    name = f"{side}_s{seed}"
    cmd = [
        sys.executable, "-m", "areal.cli", "core", "sync-ppo", "--config", str(YAML),
        f"fileroot={out}", f"experiment_name={name}", f"actor.path={sft}",
        f"total_train_steps={args.steps}", f"seed={seed}", f"gconfig.seed={seed}",
        f"eval_gconfig.seed={seed}",
        "saver.freq_steps=null",
        "launcher.echo=false", "rollout.max_staleness=0", "actor.ppo_n_minibatches=2",
        "core.backend=ray", "core.n_workers=2", f"core.allocations=[{args.train}]",
        f"evaluator.freq_steps={args.steps}", *args.extra,
    ]  # fmt: skip
    if side == "layouts":
        cmd.append(f"core.layouts=[{args.infer}]")
    trial = "run"
    try:
        wall = _run([*cmd, f"trial_name={trial}"])
    except subprocess.CalledProcessError as e:  # e.g. a local Ray that timed out starting
        print(f"[core_layouts] {name} failed (exit {e.returncode}); once more", flush=True)
        trial = "retry"
        wall = _run([*cmd, f"trial_name={trial}"])
    result = summarize(out / name / trial, wall)
    moved = result.get("realloc_bytes_per_step")
    print(
        f"[core_layouts] seed {seed} {side:>7}: held-out {result['acc_before']:.3f} -> "
        f"{result['acc_after']:.3f} ({result['gain'] * 100:+.1f}) in {result['wall_seconds']:.0f} s"
        + (
            f"; realloc {moved / 2**20:.2f} MiB, {result['realloc_seconds_mean']:.3f} s a step"
            if moved is not None
            else ""
        ),
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--train", default=TRAIN, help="the actor's allocation (its training layout)")
    ap.add_argument("--infer", default=INFER, help="actor_logp's layout on the layouts side")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_core_layouts")
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value overrides, both sides")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the digit-share task from an untrained model (no SFT needed): " + " ".join(QUICK),
    )
    args = ap.parse_args(argv)
    if args.quick:  # the reward workers import bench/layout_rewards.py
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p
        )
        args.extra = [*QUICK, *args.extra]
    sft, out = (args.sft or _default_sft()).resolve(), args.out.resolve()
    result: dict = {"steps": args.steps, "train": args.train, "infer": args.infer, "seeds": {}}
    for seed in args.seeds:
        sides = {s: run_side(s, seed, args, sft, out) for s in ("plain", "layouts")}
        sides["curve_gap"] = curve_gap(sides["plain"]["curve"], sides["layouts"]["curve"])
        print(f"[core_layouts] seed {seed} step by step, layouts vs plain: {sides['curve_gap']}")
        result["seeds"][seed] = sides
        out.mkdir(parents=True, exist_ok=True)
        (out / "core_layouts.json").write_text(json.dumps(result, indent=2))
    diffs = [(r["layouts"]["gain"] - r["plain"]["gain"]) * 100 for r in result["seeds"].values()]
    mean = statistics.mean(diffs)
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    result["gain_difference_points"] = {"per_seed": diffs, "mean": mean, "standard_error": se}
    print(
        f"[core_layouts] {args.steps} steps, seeds {args.seeds}: layouts less plain "
        f"{mean:+.1f} ± {se:.1f} held-out points (per seed {[round(d, 1) for d in diffs]})"
    )
    (out / "core_layouts.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
