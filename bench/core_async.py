"""Core async PPO vs Core sync PPO vs Lite async GRPO on the demo's task: held-out gain, samples/s
and wall time, side by side from one run.

Run (after ``make demo``, whose SFT checkpoint every side starts from):
``python bench/core_async.py [--steps 150] [--sft DIR] [--workers 2] [--rollout-workers 2]
[--out runs/bench_core_async]``.

Every side trains ``examples/arithmetic_grpo.yaml`` (two-digit addition, 8 prompts x 8 samples a
step, DAPO, one generation server) from the same SFT model for the same number of steps:

- Lite async: ``examples/gsm8k_grpo.py`` through ``areal launch local`` (``max_staleness=1``);
- Core sync: ``areal core sync-ppo``, ``rollout.max_staleness=0``, the actor data-parallel over
  ``--workers`` Ray model workers;
- Core async: ``areal core async-ppo``, ``max_staleness=1`` as Lite, the same model workers plus
  ``--rollout-workers`` rollout workers and the generation manager.

Held-out greedy accuracy (200 problems) comes from each run's step-0 and final evaluation.
Samples/s = trained samples / the steps' wall time (commit to commit, less held-out evaluation;
start-up excluded). Prints each side's gain, samples/s and wall time, and the ratios against Core sync;
writes ``OUT/core_async.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, _accuracy, _default_sft, _run  # noqa: E402


def _throughput(run_dir: Path, samples_per_step: int) -> float:
    """Trained samples per second of training steps: each step's wall time (``perf/step_seconds``,
    commit to commit) less its held-out evaluation (``timing/eval``)."""
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r["perf/step_seconds"] - r.get("timing/eval", 0.0)
             for r in rows if "perf/step_seconds" in r and r["step"] > 0}
    return len(steps) * samples_per_step / sum(steps.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--workers", type=int, default=2, help="Core model workers (Ray actors)")
    ap.add_argument("--rollout-workers", type=int, default=2, help="Core async rollout workers (Ray actors)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_core_async")
    ap.add_argument("--seed", type=int, default=None, help="the runs' seed (default: the YAML's)")
    args = ap.parse_args(argv)
    sft = (args.sft or _default_sft()).resolve()
    out = args.out.resolve()
    common = ["--config", str(YAML), f"fileroot={out}", "trial_name=run", f"actor.path={sft}",
              f"total_train_steps={args.steps}", "saver.freq_steps=null", "launcher.echo=false",
              *([f"seed={args.seed}"] if args.seed is not None else [])]
    areal = [sys.executable, "-m", "areal.cli"]
    core = ["core.backend=ray", f"core.n_workers={args.workers}"]
    sides = {  # name -> (experiment name, command)
        "lite_async": ("lite", [*areal, "launch", "local", str(REPO / "examples" / "gsm8k_grpo.py"), *common,
                                "experiment_name=lite"]),
        "core_sync": ("sync", [*areal, "core", "sync-ppo", *common, "experiment_name=sync",
                               "rollout.max_staleness=0", *core]),
        "core_async": ("async", [*areal, "core", "async-ppo", *common, "experiment_name=async", *core,
                                 f"core.n_rollout_workers={args.rollout_workers}"]),
    }
    samples_per_step = 8 * 8  # examples/arithmetic_grpo.yaml: batch_size x n_samples
    result: dict[str, dict] = {}
    for name, (experiment, cmd) in sides.items():
        wall = _run(cmd)
        before, after = _accuracy(out / experiment / "run")
        rate = _throughput(out / experiment / "run", samples_per_step)
        result[name] = {"acc_before": before, "acc_after": after, "gain": after - before, "wall_seconds": wall,
                        "samples_per_s": rate}
        print(f"[core_async] {name}: held-out {before:.3f} -> {after:.3f} ({(after - before) * 100:+.1f} points), "
              f"{rate:.1f} samples/s, {wall:.0f} s")
    base = result["core_sync"]
    print(f"[core_async] {args.steps} steps       gain    samples/s  vs Core sync   wall")
    for name, r in result.items():
        r["samples_per_s_over_core_sync"] = r["samples_per_s"] / base["samples_per_s"]
        print(f"[core_async] {name:<12} {r['gain'] * 100:+6.1f}  {r['samples_per_s']:9.1f}  "
              f"{r['samples_per_s_over_core_sync']:10.2f}x  {r['wall_seconds']:5.0f} s")
    a = result["core_async"]
    print(f"[core_async] Core async learns at least as much as Core sync: "
          f"{'yes' if a['gain'] >= base['gain'] else 'no'} ({(a['gain'] - base['gain']) * 100:+.1f} points)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "core_async.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
