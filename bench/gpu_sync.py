"""Weight sync seconds, trainer -> ``areal serve``, by mode: ``disk`` (the baseline: HF export
then ``/update_weights_from_disk``), ``distributed`` (the broadcast; NCCL on GPU, gloo on CPU)
and ``ipc`` (the colocated update: CUDA IPC handles on GPU, shared memory on CPU), each through
the real path - the FSDP engine on a one-rank group, the weight publisher, the HTTP client and
the server in its own process - on random-weight Qwen2.5 shapes built locally (no hub).

Run: ``python bench/gpu_sync.py --shape qwen2.5-0.5b qwen2.5-1.5b`` on a GPU;
``python bench/gpu_sync.py --shape tiny`` on CPU (seconds; the figures only show every mode
runs). bench/gpu.py runs it as its ``sync`` stage. The server sits on the trainer's GPU for
``disk`` and ``ipc``; NCCL refuses two ranks on one GPU, so ``distributed`` on a GPU needs a
second one (``--broadcast-device``, default ``cuda:1``) and says so when there is none. Each
figure is the best of ``--reps`` publishes after one warm-up (the broadcast's first also forms
the group), printed with its ratio to ``disk`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' server helper: `areal serve` on a free port, reaped

from areal.api.config.engine import TrainEngineConfig  # noqa: E402
from areal.api.config.rollout import InferenceEngineConfig  # noqa: E402
from areal.engine.fsdp import FSDPEngine  # noqa: E402
from areal.rollout.remote import RemoteInferenceEngine  # noqa: E402
from areal.runtime.dist import DistContext, close_distributed, init_distributed  # noqa: E402
from areal.runtime.publisher import WeightPublisher  # noqa: E402
from areal.utils.tiny_model import build_tiny_model, build_tokenizer  # noqa: E402
from tests.serving.servers import start_servers, stop_servers  # noqa: E402

_COMMON = dict(
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, num_key_value_heads=2,
)  # fmt: skip
SHAPES = {  # Qwen2.5's published configs
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, **_COMMON),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, **_COMMON),
}  # fmt: skip
MODES = ("disk", "distributed", "ipc")
TARGETS = {"ipc": 0.5, "distributed": 1.0}  # seconds (the colocated and broadcast bounds)


class _Admission:
    """No rollouts run in the bench: the publisher's pause/resume have nothing to stop."""

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass


def build_model(out: Path, shape: str, device: torch.device) -> str:
    """A random-weight HF Qwen2 dir of ``shape`` (bf16; ``tiny``: the tests' fp32 model)."""
    if shape == "tiny":
        return str(build_tiny_model(out, size="tiny", seed=0))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(**SHAPES[shape], eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device(device):  # init on the GPU: seconds
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _time_mode(
    mode: str, engine: FSDPEngine, ctx: DistContext, server_device: str, model_dir: str,
    work: Path, reps: int,
) -> float:  # fmt: skip
    """Best seconds of ``reps`` publishes of ``mode`` to a fresh server on ``server_device``."""
    dtype = "bfloat16" if server_device.startswith("cuda") else "float32"
    procs = start_servers(model_dir, 1, f"device={server_device}", f"dtype={dtype}")
    client = RemoteInferenceEngine(
        InferenceEngineConfig(setup_timeout=120, weight_update_timeout=600)
    )
    try:
        client.initialize([procs[0][1]])
        pub = WeightPublisher(mode, engine, client, _Admission(), ctx, work / mode)  # type: ignore[arg-type]
        pub.publish()  # warm-up (the broadcast forms its group here)
        best = float("inf")
        for _ in range(reps):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            pub.publish()
            best = min(best, time.perf_counter() - t)
        pub.close()
        return best
    finally:
        client.destroy()
        stop_servers(procs)


def measure(model_dir: str, work: Path, modes=MODES, reps: int = 2,
            broadcast_device: str = "cuda:1") -> dict[str, float | str]:  # fmt: skip
    """Seconds per mode (or why it was not measured), trainer on this process's device."""
    ctx = init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    engine = FSDPEngine(TrainEngineConfig(path=model_dir), ctx.mesh)
    engine.initialize(None)
    out: dict[str, float | str] = {}
    try:
        for mode in modes:
            device = str(ctx.device)
            if mode == "distributed" and ctx.device.type == "cuda":
                index = int(broadcast_device.split(":")[1])
                if torch.cuda.device_count() <= index:
                    out[mode] = f"not measured: NCCL needs the server on {broadcast_device}"
                    continue
                device = broadcast_device
            out[mode] = _time_mode(mode, engine, ctx, device, model_dir, work, reps)
    finally:
        engine.destroy()
    return out


def rows(shape: str, seconds: dict[str, float | str]) -> list[dict]:
    """One row per mode: seconds, ratio to disk, target and whether it is met."""
    base = seconds.get("disk")
    out = []
    for mode, s in seconds.items():
        ok = isinstance(s, float)
        ratio = (
            f"{base / s:.1f}x faster" if ok and isinstance(base, float) and mode != "disk" else ""
        )
        target = TARGETS.get(mode)
        met = "" if target is None or not ok else ("yes" if s <= target else "no")  # type: ignore[operator]
        out.append({"metric": f"weight sync {shape} {mode}", "value": s, "unit": "s",
                    "measured": f"{s:.3f} s" if ok else s, "vs_disk": ratio,
                    "target": f"<= {target} s" if target else "", "met": met})  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   choices=["tiny", *SHAPES])  # fmt: skip
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--broadcast-device", default="cuda:1")
    p.add_argument("--out", help="JSON file for the rows")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = []
    try:
        for shape in args.shape:
            with tempfile.TemporaryDirectory(prefix="areal-sync-bench-") as tmp:
                model_dir = build_model(Path(tmp) / "model", shape, device)
                seconds = measure(
                    model_dir, Path(tmp), args.modes, args.reps, args.broadcast_device
                )
                table += rows(shape, seconds)
    finally:
        close_distributed()
    print(f"\n## bench/gpu_sync.py on {name}\n")
    print("| metric | measured | vs disk | target | met |\n| --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['metric']} | {r['measured']} | {r['vs_disk']} | {r['target']} | {r['met']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
