"""The generator's decode-step modes side by side, in one run: eager, static compiled, and on
CUDA static under CUDA graphs with and without compile (issue #59, items 1 and 2).

Run: ``python bench/gpu_engine.py [--family qwen2|qwen3|llama|qwen3_moe] [--size tiny|small]
[--model DIR] [--device auto] [--dtype auto] [--concurrency 4 16] [--prompt-len 16]
[--new-tokens 32] [--modes ...] [--threads 2]``; ``bench/gpu.py``'s ``engine`` stage runs
:func:`compare` on its own model.

Modes (``server.compile`` / ``server.cuda_graphs``): ``eager`` (off / off: the packed eager
step), ``compiled`` (on / off), ``graphs`` (off / on, CUDA only) and ``compiled+graphs`` (on /
on, CUDA only: the server's default there). Default: every mode the device runs. Each mode gets
one generator, warmed at each concurrency first (inductor compiles and graph captures happen
then, outside the timing); then ``concurrency`` random prompts of ``--prompt-len`` tokens at
once, ``--new-tokens`` greedy tokens each (EOS ignored): tokens/s, its ratio to eager measured
in the same run, and whether the greedy tokens equal eager's. On CPU (tiny model) it only shows
that every mode runs and agrees: the CPU default is eager (see ``server.compile``'s help).
A family with sparse layers (qwen3_moe) decodes eagerly in every mode: its rows say so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal.serving.generator import Generator  # noqa: E402
from areal.serving.model import ModelSpec, read_hf_config  # noqa: E402
from areal.serving.sampling import SamplingParams  # noqa: E402
from areal.utils.tiny_model import FAMILIES, SIZES, build_tiny_model  # noqa: E402

PROMPT_VOCAB = 256  # byte tokens
MODES = {  # mode -> (server.compile, server.cuda_graphs)
    "eager": ("off", "off"),
    "compiled": ("on", "off"),
    "graphs": ("off", "on"),
    "compiled+graphs": ("on", "on"),
}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PROMPT_VOCAB, (n, length), generator=g).tolist()


def _mode_runs(gen: Generator, concurrency: list[int], prompt_len: int, new_tokens: int):
    """``{c: (tok/s, outputs)}`` of greedy runs at each concurrency, after a warm-up each."""
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for c in concurrency:  # every bucket a run passes through: compiled and captured here
        gen.generate(_prompts(c, prompt_len, seed=1), greedy)
    out = {}
    for c in concurrency:
        prompts = _prompts(c, prompt_len, seed=c)
        t = time.perf_counter()
        results = gen.generate(prompts, greedy)
        seconds = time.perf_counter() - t
        outputs = [r.output_ids for r in results]
        out[c] = (sum(map(len, outputs)) / seconds, outputs)
    return out


def compare(
    model_dir: str,
    device: str,
    dtype: torch.dtype,
    concurrency: list[int],
    prompt_len: int,
    new_tokens: int,
    modes: list[str] | None = None,
    num_threads: int = 0,
) -> list[dict]:
    """Rows ``{mode, concurrency, tok_s, ratio, same_tokens, static}`` of every mode (default:
    those ``device`` runs), ratios to ``eager``'s run in this call (eager always runs first)."""
    cuda = torch.device(device).type == "cuda"
    modes = modes or [m for m in MODES if cuda or "graphs" not in m]
    sparse = ModelSpec(read_hf_config(model_dir)).arch.experts is not None
    measured = {}
    for mode in ["eager"] + [m for m in modes if m != "eager"]:
        # "on" is refused for sparse (MoE) layers; "auto" decodes them eagerly
        compile, graphs = (t.replace("on", "auto") if sparse else t for t in MODES[mode])
        gen = Generator.from_pretrained(
            model_dir,
            device=device,
            dtype=dtype,
            compile=compile,
            cuda_graphs=graphs,
            max_batch_size=max(concurrency),
            context_length=prompt_len + new_tokens + 8,
            num_threads=num_threads,
        ).start()
        try:
            static = gen.model.static is not None
            measured[mode] = (static, _mode_runs(gen, concurrency, prompt_len, new_tokens))
        finally:
            gen.shutdown()
            del gen
            if cuda:
                torch.cuda.empty_cache()
    rows = []
    for mode, (static, runs) in measured.items():
        for c, (tok_s, outputs) in runs.items():
            base_tok_s, base_outputs = measured["eager"][1][c]
            rows.append(
                dict(
                    mode=mode,
                    concurrency=c,
                    tok_s=tok_s,
                    ratio=tok_s / base_tok_s,
                    same_tokens=outputs == base_outputs,
                    static=static,
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=FAMILIES, default="qwen2")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--model", help="an HF model dir to use instead of building --family/--size")
    ap.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--modes", nargs="+", choices=list(MODES))
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs only)")
    args = ap.parse_args()
    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    dtype_name = (
        args.dtype if args.dtype != "auto" else "bfloat16" if device != "cpu" else "float32"
    )
    if device == "cpu":
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(tmp, args.size, family=args.family))
        rows = compare(
            model_dir, device, getattr(torch, dtype_name), args.concurrency, args.prompt_len,
            args.new_tokens, args.modes, num_threads=args.threads if device == "cpu" else 0,
        )  # fmt: skip
    print(f"{args.model or args.family + ' ' + args.size} on {device} ({dtype_name}), greedy")
    print(f"{'mode':>16} {'conc':>5} {'tok/s':>9} {'/ eager':>8} {'same':>5} {'static':>6}")
    for r in rows:
        print(
            f"{r['mode']:>16} {r['concurrency']:>5} {r['tok_s']:9.0f} {r['ratio']:7.2f}x "
            f"{'yes' if r['same_tokens'] else 'NO':>5} {'yes' if r['static'] else 'no':>6}"
        )


if __name__ == "__main__":
    main()
