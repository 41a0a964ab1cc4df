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

The old per-request path no longer exists, so its figures are printed beside the new ones as
measured on this 2-core host on 2026-11-29 just before the change (``BEFORE``; issue #59
measured the plain mix at 1.47 / 5.20 ms).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from areal.serving.generator import Generator
from areal.serving.sampling import SamplingParams
from areal.utils.tiny_model import build_tiny_model

MIXES = ("plain", "seeded top-p", "stop strings")
# ms per decode step of the per-request path (a torch.Generator per seeded request, host syncs
# per check, a decode of the whole output per token for stop strings), this script on this
# 2-core host on 2026-11-29, best of 2, before the batched sampler: (concurrent, mix) -> ms
BEFORE = {
    (64, "plain"): 0.72,
    (64, "seeded top-p"): 2.98,
    (64, "stop strings"): 1.05,
    (256, "plain"): 2.74,
    (256, "seeded top-p"): 10.63,
    (256, "stop strings"): 6.41,
}


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

    def free_step(tokens, positions, prompts, cache):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        print(f"host ms per decode step (median of {args.steps} steps, best of {args.repeats})")
        print(f"{'concurrent':>10} {'mix':>14} {'now':>8} {'before':>8}")
        for batch in args.batches:
            for mix in MIXES:
                best = min(_run(model_dir, batch, args.steps, mix) for _ in range(args.repeats))
                before = BEFORE.get((batch, mix))
                before_text = f"{before:.2f}" if before is not None else "-"
                print(f"{batch:>10} {mix:>14} {best:8.3f} {before_text:>8}")


if __name__ == "__main__":
    main()
