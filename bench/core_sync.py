"""Core sync PPO vs Lite async GRPO on the demo's task: held-out gain and wall time, one run.

Run (after ``make demo``, whose SFT checkpoint both sides start from):
``python bench/core_sync.py [--steps 150] [--sft DIR] [--workers 2] [--out runs/bench_core_sync]``.

Both sides train ``examples/arithmetic_grpo.yaml`` (two-digit addition, 8 prompts x 8 samples a
step, DAPO) from the same SFT model for the same number of steps:

- Lite: ``examples/gsm8k_grpo.py`` through ``areal launch local`` (async, ``max_staleness=1``);
- Core: ``areal core sync-ppo`` with the same YAML, ``rollout.max_staleness=0`` (sync PPO:
  every batch from the current weights) and the actor data-parallel over ``--workers`` Ray model
  workers (a local Ray instance the master starts), one generation server.

Held-out greedy accuracy (200 problems) comes from each run's own step-0 and final evaluation
(the same evaluator: greedy, ``math_reward``). Prints each side's accuracy before/after, gain,
GRPO wall time, the gain difference (the acceptance of issue #19: within 5 points) and the wall
time ratio; writes ``OUT/core_sync.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
YAML = REPO / "examples" / "arithmetic_grpo.yaml"


def _run(cmd: list[str]) -> float:
    """Run ``cmd`` from the repo root; its wall time in seconds (raises on failure)."""
    start = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.time() - start


def _accuracy(run_dir: Path) -> tuple[float, float]:
    rows = [
        json.loads(line)
        for line in (run_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        raise RuntimeError(f"{run_dir}: no step-0 and final evaluation in stats.jsonl")
    return evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]


def newest_demo_checkpoint(stage: str, model: str, flag: str) -> Path:
    """The newest ``step*`` HF checkpoint of ``make demo``'s ``stage`` (sft, grpo) for ``model``."""
    steps = sorted(
        (REPO / "runs" / "quickstart" / stage / "run" / "checkpoints" / model).glob("step*"),
        key=lambda p: int(p.name[4:]),
    )
    if not steps:
        raise SystemExit(
            f"no {stage} checkpoint under runs/quickstart: run `make demo` first or pass {flag} DIR"
        )
    return steps[-1]


def _default_sft() -> Path:
    return newest_demo_checkpoint("sft", "model", "--sft")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--workers", type=int, default=2, help="Core model workers (Ray actors)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_core_sync")
    ap.add_argument(
        "--reuse-lite",
        action="store_true",
        help="take the Lite side from OUT/lite (a previous run)",
    )
    args = ap.parse_args(argv)
    sft = (args.sft or _default_sft()).resolve()
    out = args.out.resolve()
    common = [
        "--config",
        str(YAML),
        f"fileroot={out}",
        "trial_name=run",
        f"actor.path={sft}",
        f"total_train_steps={args.steps}",
        "saver.freq_steps=null",
        "launcher.echo=false",
    ]
    areal = [sys.executable, "-m", "areal.cli"]
    sides = {  # name -> (experiment name, command)
        "lite_async": (
            "lite",
            [
                *areal,
                "launch",
                "local",
                str(REPO / "examples" / "gsm8k_grpo.py"),
                *common,
                "experiment_name=lite",
            ],
        ),
        "core_sync": (
            "core",
            [
                *areal,
                "core",
                "sync-ppo",
                *common,
                "experiment_name=core",
                "rollout.max_staleness=0",
                "core.backend=ray",
                f"core.n_workers={args.workers}",
            ],
        ),
    }
    result: dict[str, dict] = {}
    for name, (experiment, cmd) in sides.items():
        if name == "lite_async" and args.reuse_lite:
            wall = (
                json.loads((out / "core_sync.json").read_text())["lite_async"]["wall_seconds"]
                if (out / "core_sync.json").is_file()
                else float("nan")
            )
        else:
            wall = _run(cmd)
        before, after = _accuracy(out / experiment / "run")
        result[name] = {
            "acc_before": before,
            "acc_after": after,
            "gain": after - before,
            "wall_seconds": wall,
        }
        print(
            f"[core_sync] {name}: held-out {before:.3f} -> {after:.3f} "
            f"({(after - before) * 100:+.1f} points) in {wall:.0f} s"
        )
    lite, core = result["lite_async"], result["core_sync"]
    result["gain_difference_points"] = (core["gain"] - lite["gain"]) * 100
    result["wall_ratio_core_over_lite"] = core["wall_seconds"] / lite["wall_seconds"]
    print(
        f"[core_sync] {args.steps} steps: gain Core sync {core['gain'] * 100:+.1f} vs Lite "
        f"async {lite['gain'] * 100:+.1f} points "
        f"(difference {result['gain_difference_points']:+.1f}; within "
        f"5: {'yes' if abs(result['gain_difference_points']) <= 5 else 'no'}); wall "
        f"Core/Lite {result['wall_ratio_core_over_lite']:.2f}x"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "core_sync.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
