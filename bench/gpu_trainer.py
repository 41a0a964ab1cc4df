"""The trainer's speed and memory levers, each on and off in one run: tokens/s, MFU and peak
memory of an SFT step (packed batch, one micro-batch) on a random-weight model, per lever.

Run on a GPU: ``python bench/gpu_trainer.py`` (Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes, random
bf16 weights built locally, no hub). CPU smoke run (its figures only show that the
configurations run; ``compile=on`` compiles for minutes on 2 cores, ``attention=flex`` cannot
train on CPU): ``python bench/gpu_trainer.py --shapes tiny --configs fused_logprobs
checkpointing=selective``. ``bench/gpu.py`` runs the same table on its own model as the stage
``levers``.

Configurations, each a fresh engine (fp32 master weights and optimizer; compute bf16 on GPU,
fp32 on CPU): ``baseline`` (every lever off: logits then logprobs, per-sequence SDPA, eager
blocks, no checkpointing), each lever alone on (``fused_logprobs``, ``attention=flex``,
``compile=on``, ``activation_checkpointing=selective`` / ``full``) and ``defaults`` (what the
engine picks on this device). Per configuration: tokens/s (best of ``--steps`` timed steps after
two warm-ups, so compilation is not timed), its ratio to the baseline measured in the same run,
MFU = 6 N tokens/s / the measured matmul peak of the compute dtype, and the peak memory
allocated (``torch.cuda.max_memory_allocated``; not measured on CPU). A configuration that
raises (e.g. FlexAttention's backward on CPU) is a row saying so; the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from areal.api.config.base import MicroBatchSpec, OptimizerConfig  # noqa: E402
from areal.api.config.engine import TrainEngineConfig  # noqa: E402
from areal.runtime.dist import close_distributed, init_distributed  # noqa: E402
from areal.utils.batch import PackedBatch  # noqa: E402
from areal.utils.tiny_model import build_tiny_model, count_parameters  # noqa: E402

SHAPES = {  # Qwen2.5 configs (tied embeddings, 151,936 vocab)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
}  # fmt: skip
OFF = {
    "fused_logprobs": False,
    "attention": "sdpa",
    "compile": "off",
    "activation_checkpointing": "none",
}
CONFIGS: dict[str, dict] = {
    "baseline": OFF,
    "fused_logprobs": {**OFF, "fused_logprobs": True},
    "attention=flex": {**OFF, "attention": "flex"},
    "compile=on": {**OFF, "compile": "on"},
    "checkpointing=selective": {**OFF, "activation_checkpointing": "selective"},
    "checkpointing=full": {**OFF, "activation_checkpointing": "full"},
    "defaults": {},
}


def build_model(out: Path, shape: str, device: torch.device) -> str:
    """A random-weight HF Qwen2 dir of ``shape`` (bf16) at ``out``; ``tiny``: the tests' model."""
    if shape == "tiny":
        return str(build_tiny_model(out, size="tiny", seed=0, max_position_embeddings=4096))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        torch_dtype="bfloat16", **SHAPES[shape],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    return str(out)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a square matmul in the compute dtype (bf16 on GPU, fp32 on CPU), best of 5."""
    cuda = device.type == "cuda"
    m, k = (8192, 10) if cuda else (1024, 1)
    dtype = torch.bfloat16 if cuda else torch.float32
    x, y = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    best = math.inf
    for _ in range(6):  # the first is a warm-up
        _sync(device)
        t = time.perf_counter()
        for _ in range(k):
            x @ y
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * m**3 * k / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(seqs: int, length: int) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (seqs, length), generator=g).tolist()
    masks = [[0] + [1] * (length - 1) for _ in ids]
    return PackedBatch.from_sequences({"input_ids": ids, "loss_mask": masks})


def measure(model_dir: str, levers: dict, batch: PackedBatch, steps: int, mesh) -> dict:
    """Best tokens/s of ``steps`` SFT steps after two warm-ups, and the peak memory (GiB)."""
    from areal.engine.sft import SFTEngine

    device = torch.device(mesh.device_type)
    cfg = TrainEngineConfig(
        path=model_dir,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=batch.n_tokens),
        optimizer=OptimizerConfig(lr=1e-5),
        **levers,
    )
    engine = SFTEngine(cfg, mesh)
    engine.initialize(None)
    try:
        for _ in range(2):
            engine.train_lm(batch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        best = math.inf
        for _ in range(steps):
            _sync(device)
            t = time.perf_counter()
            _, stats = engine.train_lm(batch)
            _sync(device)
            best = min(best, time.perf_counter() - t)
        if not math.isfinite(stats["loss"]):
            raise RuntimeError(f"training loss is {stats['loss']}: a broken step")
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return {"tokens_s": batch.n_tokens / best, "peak_gib": peak, "fused": engine.fused}
    finally:
        engine.destroy()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def lever_rows(
    model_dir: str, mesh, peak_flops: float, seqs: int, length: int, steps: int, configs=CONFIGS
):
    """``(metric, value, unit)`` rows: each configuration's tokens/s, ratio, MFU, memory (MFU
    as a fraction)."""
    n_params = count_parameters(model_dir)
    batch = _batch(seqs, length)
    rows, base = [], None
    for name in ["baseline", *(c for c in configs if c != "baseline")]:
        levers = CONFIGS[name]
        try:
            r = measure(model_dir, levers, batch, steps, mesh)
        except Exception as e:  # recorded as data: the other configurations still run
            traceback.print_exc()
            rows.append((f"levers {name}", f"error: {type(e).__name__}: {str(e)[:120]}", ""))
            continue
        base = r["tokens_s"] if name == "baseline" else base
        rows.append((f"levers {name}: train tokens/s ({seqs} x {length})", r["tokens_s"], "tok/s"))
        if base is not None and name != "baseline":
            rows.append((f"levers {name}: tokens/s / baseline", r["tokens_s"] / base, "x"))
        rows.append((f"levers {name}: MFU", 6 * n_params * r["tokens_s"] / peak_flops, "%"))
        rows.append((f"levers {name}: peak memory allocated", r["peak_gib"], "GiB"))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--shapes", nargs="+", choices=["tiny", *SHAPES], default=None)
    p.add_argument("--train-seqs", type=int, help="sequences per packed batch (32; tiny 4)")
    p.add_argument("--train-len", type=int, help="tokens per sequence (512; tiny 64)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        help="configurations besides the baseline (compile=on takes minutes on CPU)",
    )
    p.add_argument("--out", help="JSON file for the rows")
    args = p.parse_args()
    shapes = args.shapes or (list(SHAPES) if cuda else ["tiny"])
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_distributed("nccl" if cuda else "gloo").mesh
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = matmul_peak(device)
    report: dict = {"device": name, "torch": torch.__version__, "matmul_peak": peak, "rows": {}}
    print(f"device: {name}; matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    try:
        for shape in shapes:
            tiny = shape == "tiny"
            seqs = args.train_seqs or (4 if tiny else 32)
            length = args.train_len or (64 if tiny else 512)
            with tempfile.TemporaryDirectory(prefix="areal-levers-") as tmp:
                model_dir = build_model(Path(tmp) / shape, shape, device)
                rows = lever_rows(model_dir, mesh, peak, seqs, length, args.steps, args.configs)
            report["rows"][shape] = rows
            print(f"\n## trainer levers, {shape} on {name}\n\n| metric | measured |\n| --- | --- |")
            for metric, value, unit in rows:
                if isinstance(value, float) and unit == "%":
                    value = 100 * value
                shown = value if isinstance(value, str) or value is None else f"{value:.4g}"
                print(f"| {metric} | {shown} {unit} |", flush=True)
    finally:
        close_distributed()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
