"""LoRA vs full fine-tuning: peak memory and seconds per step of SFT on the arithmetic task.

The task, batch size and optimizer are those of ``examples/sft_arithmetic.yaml`` (two-digit
addition, 32 problems a step); the model is a random ``--size`` Qwen2-style model (default
``small``, ~25M parameters, so weights, gradients and AdamW state dominate memory). Each mode
runs in its own child process, so the peak RSS (``ru_maxrss``; on a GPU also
``torch.cuda.max_memory_allocated``) is that mode's alone; ``train_rss_mb`` is the peak minus
the RSS after imports (peft in both) and data, i.e. what the model and training added. Prints
both side by side and the LoRA / full ratio, measured in the same run.

Usage: python bench/lora.py [--size small] [--steps 10] [--rank 32] [--target all-linear]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(mode: str, model_dir: str, steps: int, rank: int, target: str) -> dict:
    """Train ``steps`` SFT steps (after one warm-up step) in this process; return its figures."""
    import peft  # noqa: F401 - imported in both modes, so the import's memory is the same
    import torch
    from transformers import AutoTokenizer

    from areal.api.config import SFTConfig, load_config
    from areal.api.io import FinetuneSpec
    from areal.dataset.loader import load_dataset
    from areal.engine.sft import SFTEngine
    from areal.runtime.dist import init_distributed
    from areal.utils.batch import PackedBatch

    lora = [
        f"model.lora.rank={rank}",
        f"model.lora.alpha={2 * rank}",
        f"model.lora.target_modules=[{target}]",
    ]
    cfg = load_config(
        SFTConfig,
        [
            "--config",
            str(REPO / "examples" / "sft_arithmetic.yaml"),
            f"model.path={model_dir}",
            *(lora if mode == "lora" else []),
        ],
    )
    data = load_dataset(cfg.train_dataset, AutoTokenizer.from_pretrained(model_dir), cfg.seed)
    size = cfg.train_dataset.batch_size
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # after imports and data
    engine = SFTEngine(
        cfg.model, init_distributed("gloo" if not torch.cuda.is_available() else "nccl").mesh
    )
    engine.initialize(
        FinetuneSpec(1, len(data), size, steps + 1)
    )  # the recipe's warm-up + schedule

    def batch(i: int) -> PackedBatch:
        items = [data[(i * size + j) % len(data)] for j in range(size)]
        return PackedBatch.from_sequences(
            {
                "input_ids": [it["input_ids"] for it in items],
                "loss_mask": [it["loss_mask"] for it in items],
            }
        )

    engine.train_lm(batch(0))  # warm-up: allocator, optimizer state
    start = time.perf_counter()
    for i in range(1, steps + 1):
        engine.train_lm(batch(i))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {
        "s_per_step": elapsed / steps,
        "peak_rss_mb": peak,
        "train_rss_mb": peak - base_rss,
        "trainable_params": trainable,
        "total_params": total,
    }
    if torch.cuda.is_available():
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    engine.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--target", default="all-linear", help="lora.target_modules, comma-separated")
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.steps, args.rank, args.target)))
        return
    from areal.utils.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "model", size=args.size, seed=0))
        res = {}
        for mode in ("full", "lora"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--model-dir",
                model_dir,
                "--steps",
                str(args.steps),
                "--rank",
                str(args.rank),
                "--target",
                args.target,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"SFT arithmetic, {args.size} model, batch 32, {args.steps} steps; LoRA rank {args.rank} "
        f"on {args.target}"
    )
    print(f"{'':22}{'full':>14}{'lora':>14}{'lora/full':>12}")
    for key in [k for k in res["full"] if k in res["lora"]]:
        full, lora = res["full"][key], res["lora"][key]
        print(f"{key:22}{full:>14.4g}{lora:>14.4g}{lora / full:>12.3f}")


if __name__ == "__main__":
    main()
