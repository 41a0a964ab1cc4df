"""On-policy distillation against GRPO from the same start, on the demo's task: how many steps
each needs to reach the teacher's held-out accuracy.

Run (after ``make demo``: its SFT model is the student, its GRPO model the teacher):
``python bench/distill.py [--steps 150] [--seeds 1,2,3] [--eval-every 10] [--sft DIR]
[--teacher DIR] [--out runs/bench_distill] [--sides distill,grpo] [--distill-set KEY=VALUE ...]
[--grpo-set KEY=VALUE ...]`` (``--distill-set`` overrides the distillation side only, e.g.
``distill.coef=5``; ``--grpo-set`` the GRPO side only, e.g. a control at the distillation side's
batch shape).

Per seed, two runs of ``examples/gsm8k_grpo.py`` through ``areal launch local`` from the SFT
model: ``examples/arithmetic_distill.yaml`` (the teacher's servers score every completion; the
per-token reverse KL is the advantage, no task reward) and ``examples/arithmetic_grpo.yaml``
(the demo's GRPO). Both evaluate held-out greedy accuracy (200 problems) every ``--eval-every``
steps. The teacher's accuracy is its own evaluation on the same problems (``areal eval``). Per
run: the first evaluated step at or above the teacher's accuracy (none if never), the final
accuracy and the wall time; then the mean over seeds. Writes ``OUT/distill.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, _default_sft, _run, newest_demo_checkpoint  # noqa: E402

DISTILL_YAML = REPO / "examples" / "arithmetic_distill.yaml"


def _evals(run_dir: Path) -> list[tuple[int, float]]:
    rows = [
        json.loads(line)
        for line in (run_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--sft", type=Path, default=None)
    ap.add_argument("--teacher", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_distill")
    ap.add_argument(
        "--distill-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for the distillation side only (e.g. distill.coef=5)",
    )
    ap.add_argument(
        "--grpo-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for the GRPO side only (e.g. gconfig.n_samples=1 ...)",
    )
    ap.add_argument(
        "--sides", default="distill,grpo", help="which sides to run (a sweep: distill alone)"
    )
    args = ap.parse_args(argv)
    sft, teacher = (
        (args.sft or _default_sft()).resolve(),
        (args.teacher or newest_demo_checkpoint("grpo", "actor", "--teacher")).resolve(),
    )
    from areal.evaluate import run_eval

    target = float(run_eval(str(teacher), ["--config", str(YAML)])["accuracy"])
    print(f"[distill] teacher {teacher}: held-out accuracy {target:.3f}", flush=True)
    sides = {
        "distill": [DISTILL_YAML, f"distill.teacher_path={teacher}", *args.distill_set],
        "grpo": [YAML, *args.grpo_set],
    }
    sides = {side: sides[side] for side in args.sides.split(",")}
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side, (config, *extra) in sides.items():
            name = f"{side}-s{seed}"
            wall = _run(
                [
                    sys.executable,
                    "-m",
                    "areal.cli",
                    "launch",
                    "local",
                    str(REPO / "examples" / "gsm8k_grpo.py"),
                    "--config",
                    str(config),
                    f"fileroot={args.out}",
                    f"experiment_name={name}",
                    "trial_name=run",
                    f"actor.path={sft}",
                    f"total_train_steps={args.steps}",
                    f"evaluator.freq_steps={args.eval_every}",
                    "saver.freq_steps=null",
                    "launcher.echo=false",
                    f"seed={seed}",
                    *extra,
                ]
            )
            evals = _evals(args.out / name / "run")
            reached = next((step for step, acc in evals if step > 0 and acc >= target), None)
            results[side].append(
                {
                    "seed": seed,
                    "reached_at": reached,
                    "start": evals[0][1],
                    "final": evals[-1][1],
                    "wall_s": wall,
                    "evals": evals,
                }
            )
            print(
                f"[distill] {name}: reaches {target:.3f} at step {reached}; {evals[0][1]:.3f} -> "
                f"{evals[-1][1]:.3f} in {wall:.0f} s",
                flush=True,
            )
    print(
        f"\nteacher accuracy {target:.3f}; {args.steps} steps, evaluation every {args.eval_every}"
    )
    print(
        "| side | steps to the teacher's accuracy (per seed) | final accuracy (mean) | wall s "
        "(mean) |\n| --- | --- | --- | --- |"
    )
    for side, runs in results.items():
        reached = ", ".join(
            str(r["reached_at"]) if r["reached_at"] is not None else f">{args.steps}" for r in runs
        )
        print(
            f"| {side} | {reached} | {statistics.fmean(r['final'] for r in runs):.3f} | "
            f"{statistics.fmean(r['wall_s'] for r in runs):.0f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distill.json").write_text(
        json.dumps({"teacher_accuracy": target, **results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
