"""Core async PPO vs Core sync PPO vs Lite async GRPO on the demo's task: held-out gain, samples/s
and wall time, side by side from one run.

Run (after ``make demo``, whose SFT checkpoint every side starts from):
``python bench/core_async.py [--steps 150] [--sft DIR] [--workers 2] [--rollout-workers 2]
[--out runs/bench_core_async] [--seeds 1,2,3] [--sides core_sync,core_async]``.

Every side trains ``examples/arithmetic_grpo.yaml`` (two-digit addition, 8 prompts x 8 samples a
step, DAPO, one generation server) from the same SFT model for the same number of steps:

- Lite async: ``examples/gsm8k_grpo.py`` through ``areal launch local`` (``max_staleness=1``);
- Core sync: ``areal core sync-ppo``, ``rollout.max_staleness=0``, the actor data-parallel over
  ``--workers`` Ray model workers;
- Core async: ``areal core async-ppo``, ``max_staleness=1`` as Lite, the same model workers plus
  ``--rollout-workers`` rollout workers and the generation manager.

Held-out greedy accuracy (200 problems) comes from each run's own evaluations (every 25 steps):
the gain is the final one's less step 0's; the "last-3 gain" averages the last three first.
Each side's final model (``checkpoints/actor/step<steps>``) is also evaluated offline on the whole
test split (~800 problems, ``FULL_TEST`` overrides): greedy, and sampled at temperature 1 (4
samples a problem), the reward the RL objective maximises; 4x the problems of the in-run
evaluations, so 1.7 instead of 3.5 points of evaluation noise, against the SFT model the same way.
Samples/s = trained samples / the steps' wall time (commit to commit, less held-out evaluation;
start-up excluded). Prints each side's gain, samples/s and wall time, and the ratios against
Core sync, per seed and (with ``--seeds``) their mean: one run's gain moves by several points
with the seed (200 held-out problems), so "learns as much" is read off the mean; writes
``OUT/core_async.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, _accuracy, _default_sft, _run  # noqa: E402


def _late_gain(run_dir: Path, k: int = 3) -> float:
    """Mean held-out accuracy of the last ``k`` evaluations less step 0's: the gain with less of
    one evaluation's swing (a policy can move by 10+ points between two evaluations)."""
    rows = [
        json.loads(line)
        for line in (run_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return sum(evals[-k:]) / len(evals[-k:]) - evals[0]


def _throughput(run_dir: Path, samples_per_step: int) -> float:
    """Trained samples per second of training steps: each step's wall time (``perf/step_seconds``,
    commit to commit) less its held-out evaluation (``timing/eval``)."""
    rows = [
        json.loads(line)
        for line in (run_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = {
        r["step"]: r["perf/step_seconds"] - r.get("timing/eval", 0.0)
        for r in rows
        if "perf/step_seconds" in r and r["step"] > 0
    }
    return len(steps) * samples_per_step / sum(steps.values())


FULL_TEST = [
    "valid_dataset.arithmetic.n_test=800"
]  # all but a few of the test split's ~810 problems
# seeded (per problem, sample and version), so a model's sampled accuracy is the same in every run
SAMPLED = [
    "eval_gconfig.greedy=false",
    "eval_gconfig.temperature=1.0",
    "eval_gconfig.n_samples=4",
    "eval_gconfig.seed=0",
]


def _full_test(model: Path) -> dict[str, float]:
    """Greedy and sampled accuracy of ``model`` on the whole test split (``areal eval``)."""
    from areal.evaluate import run_eval

    base = ["--config", str(YAML), *FULL_TEST]
    return {
        "greedy_800": float(run_eval(str(model), base)["accuracy"]),
        "sampled_800": float(run_eval(str(model), [*base, *SAMPLED])["accuracy"]),
    }


def _side_commands(
    args: argparse.Namespace, sft: Path, out: Path, seed: int | None
) -> dict[str, tuple]:
    """name -> (experiment name, command) of each side, writing under ``out``."""
    common = [
        "--config",
        str(YAML),
        f"fileroot={out}",
        "trial_name=run",
        f"actor.path={sft}",
        f"total_train_steps={args.steps}",
        "saver.freq_steps=null",
        "launcher.echo=false",
        *([f"seed={seed}"] if seed is not None else []),
    ]
    areal = [sys.executable, "-m", "areal.cli"]
    core = ["core.backend=ray", f"core.n_workers={args.workers}"]
    return {
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
            "sync",
            [
                *areal,
                "core",
                "sync-ppo",
                *common,
                "experiment_name=sync",
                "rollout.max_staleness=0",
                *core,
            ],
        ),
        "core_async": (
            "async",
            [
                *areal,
                "core",
                "async-ppo",
                *common,
                "experiment_name=async",
                *core,
                f"core.n_rollout_workers={args.rollout_workers}",
            ],
        ),
    }


def _run_seed(
    args: argparse.Namespace,
    sft: Path,
    out: Path,
    seed: int | None,
    sides: list[str],
    start: dict[str, float],
) -> dict:
    """Run ``sides`` for one seed; name -> its figures (ratios against this seed's Core sync;
    ``start``: the SFT model's :func:`_full_test`)."""
    commands = _side_commands(args, sft, out, seed)
    samples_per_step = 8 * 8  # examples/arithmetic_grpo.yaml: batch_size x n_samples
    result: dict[str, dict] = {}
    for name in sides:
        experiment, cmd = commands[name]
        wall = _run(cmd)
        before, after = _accuracy(out / experiment / "run")
        rate = _throughput(out / experiment / "run", samples_per_step)
        final = _full_test(out / experiment / "run" / "checkpoints" / "actor" / f"step{args.steps}")
        result[name] = {
            "acc_before": before,
            "acc_after": after,
            "gain": after - before,
            "gain_last3": _late_gain(out / experiment / "run"),
            "wall_seconds": wall,
            "samples_per_s": rate,
            **{f"gain_{k}": v - start[k] for k, v in final.items()},
        }
        print(
            f"[core_async] seed {seed}: {name}: held-out {before:.3f} -> {after:.3f} "
            f"({(after - before) * 100:+.1f} points), {rate:.1f} samples/s, {wall:.0f} s; final "
            f"model on 800: greedy {final['greedy_800']:.3f}, sampled {final['sampled_800']:.3f}"
        )
    for r in result.values():
        r["samples_per_s_over_core_sync"] = (
            r["samples_per_s"] / result["core_sync"]["samples_per_s"]
        )
    return result


def _table(title: str, result: dict[str, dict]) -> None:
    print(
        f"[core_async] {title:<17} gain  last-3 gain  800 greedy  800 sampled  samples/s  vs Core "
        "sync   wall"
    )
    for name, r in result.items():
        print(
            f"[core_async] {name:<12} {r['gain'] * 100:+11.1f}  {r['gain_last3'] * 100:+11.1f}  "
            f"{r['gain_greedy_800'] * 100:+10.1f}  {r['gain_sampled_800'] * 100:+11.1f}  "
            f"{r['samples_per_s']:9.1f}  "
            f"{r['samples_per_s_over_core_sync']:10.2f}x  {r['wall_seconds']:5.0f} s"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--workers", type=int, default=2, help="Core model workers (Ray actors)")
    ap.add_argument(
        "--rollout-workers", type=int, default=2, help="Core async rollout workers (Ray actors)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_core_async")
    ap.add_argument(
        "--seeds",
        default="",
        help="comma-separated run seeds, one run of every side each, "
        "then the mean (default: one run with the YAML's seed)",
    )
    ap.add_argument(
        "--sides",
        default="lite_async,core_sync,core_async",
        help="sides to run, comma-separated; core_sync (the ratios' baseline) always runs",
    )
    args = ap.parse_args(argv)
    sft = (args.sft or _default_sft()).resolve()
    out = args.out.resolve()
    known = list(_side_commands(args, sft, out, None))
    wanted = set(args.sides.split(",")) | {"core_sync"}
    if wanted - set(known):
        ap.error(f"--sides {args.sides}: {sorted(wanted - set(known))} not among {known}")
    sides = [name for name in known if name in wanted]
    seeds = [int(s) for s in args.seeds.split(",") if s] or [None]
    start = _full_test(sft)
    print(
        f"[core_async] SFT model on 800 held-out problems: greedy {start['greedy_800']:.3f}, "
        f"sampled {start['sampled_800']:.3f}"
    )
    runs = {}
    for seed in seeds:
        runs[seed] = _run_seed(
            args, sft, out if seed is None else out / f"seed{seed}", seed, sides, start
        )
        _table(f"seed {seed}, {args.steps} steps", runs[seed])
    mean = {
        name: {
            key: sum(r[name][key] for r in runs.values()) / len(runs)
            for key in runs[seeds[0]][name]
        }
        for name in sides
    }
    if len(seeds) > 1:
        _table(f"mean of {len(seeds)} seeds", mean)
    for key, what in (
        ("gain", "final evaluation"),
        ("gain_last3", "mean of the last 3 evaluations"),
        ("gain_greedy_800", "final model, 800 problems, greedy"),
        ("gain_sampled_800", "final model, 800 problems, sampled"),
    ):
        if "core_async" in mean:
            diffs = [r["core_async"][key] - r["core_sync"][key] for r in runs.values()]
            diff = sum(diffs) / len(diffs)
            spread = (
                f", standard error {statistics.stdev(diffs) / len(diffs) ** 0.5 * 100:.1f}, "
                f"below in {sum(d < 0 for d in diffs)} of {len(diffs)} seeds"
                if len(diffs) > 1
                else ""
            )
            print(
                f"[core_async] Core async learns at least as much as Core sync ({what}"
                f"{f', mean of {len(seeds)} seeds' if len(seeds) > 1 else ''}): "
                f"{'yes' if diff >= 0 else 'no'} ({diff * 100:+.1f} points{spread})"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "core_async.json").write_text(
        json.dumps({"runs": {str(k): v for k, v in runs.items()}, "mean": mean}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
