"""Host time per decode step of the embedded generator, with a free model (issue #59).

Run: ``python bench/host_step.py [--batches 64 256] [--steps 64] [--repeats 3]``.

The model's step is replaced by a function returning preallocated logits of the tiny model's
vocabulary (a few hundred tokens), so no model arithmetic is timed: what remains is the
generator's own work per step (building the step's inputs, sampling, the device->host copy,
appending tokens, finish checks, retiring). ``B`` requests are submitted at once into a
generator of ``B`` slots and decode ``--steps`` tokens each (EOS ignored); each figure is the
median time of the decode steps (the first step, which admits the prompts, is left out), the
best of ``--repeats`` runs on a shared host. Mixes: ``plain`` (temperature 1, unseeded),
``seeded top-p`` (each request its own seed, top_p 0.9, top_k 50) and ``stop strings`` (half the
requests with a stop string that never matches, so its text is checked every step).

Baseline, measured in the same run: the same measurement of the per-request path (a
torch.Generator per seeded request, host syncs per check, a decode of the whole output per token
for stop strings), i.e. areal at ``--baseline-rev`` (default: the commit before the batched
sampler), exported with ``git archive`` into a temporary directory and run in a subprocess with
that tree first on ``PYTHONPATH``; the ratio is baseline / now. Issue #59 measured the plain mix
at 1.47 / 5.20 ms; this script measured 0.72 / 2.74 ms for it on 2026-11-29.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal.serving.generator import Generator
from areal.serving.sampling import SamplingParams
from areal.utils.tiny_model import build_tiny_model

MIXES = ("plain", "seeded top-p", "stop strings")
BASELINE_REV = "ef4bc86"  # the last commit with the per-request sampler
REPO = Path(__file__).resolve().parents[1]


def _params(mix: str, i: int, steps: int) -> SamplingParams:
    base = dict(max_new_tokens=steps, temperature=1.0, ignore_eos=True)
    if mix == "seeded top-p":
        return SamplingParams(**base, seed=i, top_p=0.9, top_k=50)
    if mix == "stop strings" and i % 2:
        return SamplingParams(**base, stop=("\x00never\x00",))
    return SamplingParams(**base)


def _run(model_dir: str, batch: int, steps: int, mix: str) -> float:
    """Median host ms of the decode steps of one run."""
    gen = Generator.from_pretrained(model_dir, cpu_attention="torch", max_batch_size=batch)
    V = gen.model.spec.vocab_size
    logits = torch.randn(batch, V, device=gen.model.device).float()  # [B, V], preallocated

    def free_step(tokens, positions, prompts, cache, *_):  # *_: prefix starts, if any
        return logits[: tokens.shape[0] + len(prompts)]

    gen.model.step = free_step  # the free model
    times: list[float] = []
    step = gen._step

    def timed(admitted):
        t0 = time.perf_counter()
        step(admitted)
        if not admitted:
            times.append(time.perf_counter() - t0)

    gen._step = timed
    prompts = [[(7 * i + j) % 200 + 1 for j in range(16)] for i in range(batch)]
    try:
        gen.start().generate(prompts, [_params(mix, i, steps) for i in range(batch)])
    finally:
        gen.shutdown()
    return 1e3 * statistics.median(times[:-1])  # the last step retires everyone


def _measure(args: argparse.Namespace) -> dict[str, float]:
    """``{"B mix": best ms}`` for the areal this interpreter imports."""
    torch.set_num_threads(args.threads)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        for batch in args.batches:
            for mix in MIXES:
                runs = [_run(model_dir, batch, args.steps, mix) for _ in range(args.repeats)]
                out[f"{batch} {mix}"] = min(runs)
    return out


def _baseline(args: argparse.Namespace) -> dict[str, float]:
    """:func:`_measure` of areal at ``--baseline-rev``, in a subprocess over its exported tree."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.baseline_rev, "areal"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True, timeout=120)
        argv = [sys.executable, __file__, "--json", "--steps", str(args.steps)]
        argv += ["--repeats", str(args.repeats), "--threads", str(args.threads), "--batches"]
        argv += [str(b) for b in args.batches]
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"baseline at {args.baseline_rev} failed:\n{done.stderr[-2000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        if not out.pop("areal").startswith(tree):  # the baseline must not be this tree
            raise SystemExit(f"the baseline imported another areal than {args.baseline_rev}'s")
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a baseline's run
    args = ap.parse_args()
    if args.json:
        import areal

        print(json.dumps({"areal": str(Path(areal.__file__).parent), **_measure(args)}))
        return
    before = _baseline(args)
    now = _measure(args)
    print(f"host ms per decode step (median of {args.steps} steps, best of {args.repeats})")
    print(f"{'concurrent':>10} {'mix':>14} {'now':>8} {args.baseline_rev:>8} {'ratio':>6}")
    for key, ms in now.items():
        batch, mix = key.split(" ", 1)
        base = before[key]
        print(f"{batch:>10} {mix:>14} {ms:8.3f} {base:8.3f} {base / ms:5.2f}x")


if __name__ == "__main__":
    main()
