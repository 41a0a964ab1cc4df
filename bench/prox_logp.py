"""Proximal logprobs: the exact forward pass (``actor.prox_logp=recompute``) against the
approximation (``loglinear``) on the demo's task, with stale samples and several minibatches.

Run (after ``make demo``, whose SFT checkpoint both sides start from):
``python bench/prox_logp.py [--steps 150] [--seeds 1,2,3] [--staleness 4] [--minibatches 4]
[--sides recompute,loglinear] [--sft DIR] [--out runs/bench_prox_logp]``.

Each side trains ``examples/arithmetic_grpo.yaml`` through ``areal launch local`` with
``rollout.max_staleness`` = ``--staleness`` and ``actor.ppo_n_minibatches`` = ``--minibatches``
(the setting where the proximal policy needs its own forward pass), once per seed. Per run:
held-out gain (final less step 0, 200 problems), time per training step (``timing/train`` +
``timing/prox_logp``: the update and the proximal pass, what the approximation saves) and the
whole step's wall time, the observed staleness; then the mean and spread (min..max) over seeds
per side, and loglinear's ratios against recompute. Writes ``OUT/prox_logp.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, _accuracy, _default_sft, _run  # noqa: E402


def _run_figures(run_dir: Path) -> dict[str, float]:
    rows = [
        json.loads(line)
        for line in (run_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in rows if r["step"] > 0 and "timing/train" in r]
    first, last = _accuracy(run_dir)
    mean = statistics.fmean
    return {
        "gain": last - first,
        "final": last,
        "update_s": mean(r["timing/train"] + r.get("timing/prox_logp", 0.0) for r in steps),
        "prox_pass_s": mean(r.get("timing/prox_logp", 0.0) for r in steps),
        "step_s": mean(r["perf/step_seconds"] - r.get("timing/eval", 0.0) for r in steps),
        "staleness_mean": mean(r["staleness/mean"] for r in steps),
        "staleness_max": max(r["staleness/max"] for r in steps),
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--staleness", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--sides", default="recompute,loglinear")
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_prox_logp")
    args = ap.parse_args(argv)
    sft = (args.sft or _default_sft()).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    for side in args.sides.split(","):
        for seed in seeds:
            name = f"{side}-s{seed}"
            _run(
                [
                    sys.executable,
                    "-m",
                    "areal.cli",
                    "launch",
                    "local",
                    str(REPO / "examples" / "gsm8k_grpo.py"),
                    "--config",
                    str(YAML),
                    f"fileroot={args.out}",
                    f"experiment_name={name}",
                    "trial_name=run",
                    f"actor.path={sft}",
                    f"total_train_steps={args.steps}",
                    "saver.freq_steps=null",
                    "launcher.echo=false",
                    f"seed={seed}",
                    f"rollout.max_staleness={args.staleness}",
                    f"actor.ppo_n_minibatches={args.minibatches}",
                    f"actor.prox_logp={side}",
                ]
            )
            figures = _run_figures(args.out / name / "run")
            results.setdefault(side, []).append({"seed": seed, **figures})
            print(f"[prox_logp] {name}: {figures}", flush=True)
    print(
        f"\n{args.steps} steps, max_staleness {args.staleness}, {args.minibatches} minibatches, "
        f"seeds {seeds}: mean (min..max)"
    )
    keys = ["gain", "update_s", "prox_pass_s", "step_s", "staleness_mean"]
    print("| side | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for side, runs in results.items():
        print(f"| {side} | " + " | ".join(_spread([r[k] for r in runs]) for k in keys) + " |")
    if {"recompute", "loglinear"} <= set(results):
        mean = {s: {k: statistics.fmean(r[k] for r in results[s]) for k in keys} for s in results}
        print(
            "loglinear / recompute: update "
            f"time {mean['loglinear']['update_s'] / mean['recompute']['update_s']:.2f}x, step "
            f"time {mean['loglinear']['step_s'] / mean['recompute']['step_s']:.2f}x, "
            f"gain {mean['loglinear']['gain'] - mean['recompute']['gain']:+.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prox_logp.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
