"""LoRA vs full fine-tuning: held-out accuracy of SFT on the arithmetic task from the same base.

LoRA adapts a *pretrained* model with a low-rank update; a random model is no such base. So the
protocol is:

1. base: the tiny random model (``areal tiny-model``, seed 0) fully fine-tuned for
   ``--base-steps`` SFT steps with ``examples/sft_arithmetic.yaml`` (the demo's recipe: batch 32,
   lr 1e-3, 4% warm-up; 300 steps is the demo's SFT model, ~16% held out); ``--base DIR``
   reuses an HF model dir instead;
2. from that same base, ``--steps`` more SFT steps twice, with the same recipe and data order:
   full fine-tuning (the recipe's lr) and LoRA (``--rank``, ``--alpha``, ``--target``, the
   modules trained in full ``--save``, lr ``--lora-lr``; a comma-separated list runs one LoRA
   run per value, an lr sweep); ``--save embed_tokens`` trains the (tied) token embeddings in
   full too (``lora.modules_to_save``), adapters alone by default;
3. held-out greedy accuracy of the base, full and LoRA models (``areal eval`` with
   ``examples/arithmetic_grpo.yaml``: the 200 held-out problems), printed with LoRA - full.

Each SFT run is ``areal launch local examples/sft.py`` (its own processes); the LoRA run's HF
export is the merged model, so the evaluation serves it like any other.

Usage: python bench/lora_accuracy.py [--base-steps 300] [--steps 200] [--rank 16] [--alpha 32]
       [--lora-lr 1e-3[,2e-3...]] [--target all-linear] [--save MODULES] [--base DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "sft_arithmetic.yaml"
EVAL_CONFIG = REPO / "examples" / "arithmetic_grpo.yaml"
AREAL = [sys.executable, "-m", "areal.cli"]


def sft(work: Path, name: str, model: str, steps: int, extra: list[str]) -> tuple[str, float]:
    """(HF export dir after ``steps`` SFT steps of the recipe from ``model``, wall seconds)."""
    start = time.perf_counter()
    cmd = [
        *AREAL,
        "launch",
        "local",
        "examples/sft.py",
        "--config",
        str(RECIPE),
        f"model.path={model}",
        f"fileroot={work}",
        f"experiment_name={name}",
        "trial_name=t",
        f"total_train_steps={steps}",
        f"saver.freq_steps={steps}",
        f"evaluator.freq_steps={steps}",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(
            f"SFT {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    out = work / name / "t" / "checkpoints" / "model" / f"step{steps}"
    if not out.is_dir():
        raise RuntimeError(f"SFT {name} finished without its export {out}")
    return str(out), time.perf_counter() - start


def accuracy(model: str) -> float:
    """Held-out greedy accuracy of the HF model dir ``model`` (``areal eval``)."""
    from areal.evaluate import run_eval

    return float(run_eval(model, ["--config", str(EVAL_CONFIG)])["accuracy"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="HF model dir to start from (skips the base SFT)")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200, help="SFT steps of each of the two runs")
    ap.add_argument("--full-lr", type=float, default=1e-3)
    ap.add_argument("--lora-lr", default="1e-3", help="LoRA learning rate(s), comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--target", default="all-linear", help="lora.target_modules, comma-separated")
    ap.add_argument(
        "--save",
        default="",
        help="lora.modules_to_save, comma-separated (e.g. embed_tokens; default: adapters alone)",
    )
    ap.add_argument("--work", help="keep the runs here (default: a temporary dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp).resolve()
        times = {}
        base = args.base
        if base is None:
            from areal.utils.tiny_model import build_tiny_model

            tiny = str(build_tiny_model(work / "tiny", size="tiny", seed=0))
            base, times["base"] = sft(work, "base", tiny, args.base_steps, [])
        lora = [
            f"model.lora.rank={args.rank}",
            f"model.lora.alpha={args.alpha}",
            f"model.lora.target_modules=[{args.target}]",
            f"model.lora.modules_to_save=[{args.save}]",
        ]
        full, times["full"] = sft(
            work, "full", base, args.steps, [f"model.optimizer.lr={args.full_lr}"]
        )
        acc = {"base": accuracy(base), "full": accuracy(full)}
        for lr in args.lora_lr.split(","):
            name = f"lora lr {lr}"
            adapted, times[name] = sft(
                work, f"lora-{lr}", base, args.steps, [*lora, f"model.optimizer.lr={lr}"]
            )
            acc[name] = accuracy(adapted)
    start = f"{args.base_steps} full SFT steps" if args.base is None else args.base
    print(
        f"SFT arithmetic, tiny model; base: {start}; then {args.steps} steps each: full "
        f"(lr {args.full_lr}) vs LoRA (rank {args.rank}, alpha {args.alpha:g}, {args.target}; "
        f"trained in full: {args.save or 'none'})"
    )
    print(f"held-out greedy accuracy: base {acc['base']:.1%}, full {acc['full']:.1%}")
    for name in [k for k in acc if k.startswith("lora")]:
        print(
            f"  {name}: {acc[name]:.1%}; LoRA - full {100 * (acc[name] - acc['full']):+.1f} points"
        )
    print("wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
