"""What recording samples for ``areal view`` costs the demo's GRPO: wall time on vs off, and size.

Run: ``python bench/recording.py [--steps 20] [--pairs 2] [--replay] [--sft DIR]
[--out runs/bench_recording]``.

The same short GRPO run of the demo (``examples/gsm8k_grpo.py`` with
``examples/arithmetic_grpo.yaml`` through ``areal launch local``, no held-out evaluation) runs ``2 *
--pairs`` times, alternating ``stats_logger.samples.enabled=true`` and ``false`` (on, off, on, off,
...) so that a shared machine's load drifts over both sides alike; with ``--replay`` a third run per
round also records for ``areal replay`` (``stats_logger.replay.enabled``). The model is make demo's
SFT checkpoint (``--sft``, default the newest under runs/quickstart); without one, the tiny random
model the demo starts SFT from, with ``actor.dynamic_sampling=false`` (it scores 0 everywhere: DAPO
would reject every group). Its batches have the demo's shape (8 prompts x 8 samples, 6 new tokens)
and its steps are shorter (no rejected groups to replace), so the recording's share of a step is, if
anything, larger than the demo's.

Per run: wall time (launch to exit), the training loop's time (the sum of ``perf/step_seconds``
over steps 2.., step 1 having none) and the recorder's own time over the same steps
(``timing/record_samples``, the entry script's timer around it; its first call, which also
imports pyarrow, apart).
Prints the mean of each side, the on/off ratios (the acceptance of issue #39: at most 1.05) and
the recorded size per 1,000 samples; writes ``OUT/recording.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core_sync import REPO, YAML, newest_demo_checkpoint  # noqa: E402

SCRIPT = REPO / "examples" / "gsm8k_grpo.py"


def _model(sft: Path | None, out: Path) -> tuple[Path, list[str]]:
    """(the actor's model dir, extra overrides) per the module docstring."""
    if sft is not None:
        return sft, []
    try:
        return newest_demo_checkpoint("sft", "model", "--sft"), []
    except SystemExit:
        from areal.utils.tiny_model import build_tiny_model

        print("[recording] no demo SFT checkpoint: the tiny random model, no dynamic sampling")
        build_tiny_model(out / "tiny", size="tiny", seed=0)
        return out / "tiny", ["actor.dynamic_sampling=false"]


def _count_samples(files: list[Path]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in files)


def _one_run(out: Path, name: str, model: Path, steps: int, side: str, extra: list[str]):
    """Launch one run to the end (``side``: on, off or replay); its figures."""
    overrides = [
        f"fileroot={out}", f"experiment_name={name}", "trial_name=run", f"actor.path={model}",
        f"total_train_steps={steps}", "valid_dataset=null", "seed=1",
        f"stats_logger.samples.enabled={str(side != 'off').lower()}",
        f"stats_logger.replay.enabled={str(side == 'replay').lower()}", *extra,
        # a loaded machine can starve a fresh reward worker's warm-up past the default 30 s,
        # and a killed worker's replacement starts over: a deadline that waits for it instead
        "reward.timeout=300",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "areal.cli", "launch", "local", str(SCRIPT), "--config", str(YAML)]
    start = time.time()
    with open(out / f"{name}.out", "wb") as log:
        subprocess.run([*cmd, *overrides], cwd=REPO, check=True, stdout=log, stderr=log)
    wall = time.time() - start
    run_dir = out / name / "run"
    rows = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1)  # its step time is not measured
    rows = [r for r in rows if r.get("step", 0) > 1 and "perf/step_seconds" in r]
    files = list((run_dir / "samples").glob("*.parquet"))
    replay = sum(p.stat().st_size for p in (run_dir / "replay").glob("*") if p.is_file())
    return {
        "side": side,
        "wall_s": wall,
        "loop_s": sum(r["perf/step_seconds"] for r in rows),
        "record_s": sum(r.get("timing/record_samples", 0.0) for r in rows),
        "first_record_s": first.get("timing/record_samples", 0.0),  # + importing pyarrow
        "samples": _count_samples(files),
        "bytes": sum(p.stat().st_size for p in files),
        "replay_bytes": replay,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=2, help="on/off pairs, run interleaved")
    ap.add_argument("--replay", action="store_true", help="a third run per round: + replay")
    ap.add_argument("--off-first", action="store_true", help="each round: off, then on")
    ap.add_argument("--sft", type=Path, default=None, help="SFT model dir (default: make demo's)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_recording")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, extra = _model(args.sft, out)
    runs = []
    for i in range(args.pairs):
        order = ("off", "on") if args.off_first else ("on", "off")
        for side in (*order, *(["replay"] if args.replay else [])):
            name = f"{side}{i}"
            runs.append(_one_run(out, name, model, args.steps, side, extra))
            r = runs[-1]
            print(
                f"[recording] {name}: wall {r['wall_s']:.1f} s, loop {r['loop_s']:.1f} s, "
                f"recorder {r['record_s']:.2f} s, {r['bytes']} bytes",
                flush=True,
            )
    summary = _summary(runs, args, model, extra)
    (out / "recording.json").write_text(json.dumps({"runs": runs, **summary}, indent=1))
    return 0


def _summary(runs: list[dict], args, model: Path, extra: list[str]) -> dict:
    mean = statistics.fmean
    on = [r for r in runs if r["side"] == "on"]
    off = [r for r in runs if r["side"] == "off"]
    replay = [r for r in runs if r["side"] == "replay"]
    s = {
        "model": str(model), "extra": extra, "steps": args.steps, "pairs": args.pairs,
        "wall_ratio": mean(r["wall_s"] for r in on) / mean(r["wall_s"] for r in off),
        "loop_ratio": mean(r["loop_s"] for r in on) / mean(r["loop_s"] for r in off),
        "recorder_share": mean(r["record_s"] / r["loop_s"] for r in on),
        "bytes_per_1000_samples":
            1000 * sum(r["bytes"] for r in on) / sum(r["samples"] for r in on),
    }  # fmt: skip
    if replay:
        s["replay_wall_ratio"] = mean(r["wall_s"] for r in replay) / mean(r["wall_s"] for r in off)
        s["replay_loop_ratio"] = mean(r["loop_s"] for r in replay) / mean(r["loop_s"] for r in off)
        samples = sum(r["samples"] for r in replay)
        s["replay_bytes_per_1000_samples"] = 1000 * sum(r["replay_bytes"] for r in replay) / samples
        print(
            f"[recording] + replay recording: wall {s['replay_wall_ratio']:.3f}, loop "
            f"{s['replay_loop_ratio']:.3f} of off; "
            f"{s['replay_bytes_per_1000_samples'] / 1024:.0f} KiB per 1,000 samples"
        )
    print(
        f"[recording] {args.pairs} pairs x {args.steps} steps, interleaved on/off: wall on/off "
        f"{s['wall_ratio']:.3f}, training loop on/off {s['loop_ratio']:.3f} (<= 1.05 wanted); "
        f"the recorder itself {100 * s['recorder_share']:.2f}% of the loop (steps 2..), "
        f"{mean(r['first_record_s'] for r in on):.2f} s at step 1 (importing pyarrow); "
        f"{s['bytes_per_1000_samples'] / 1024:.0f} KiB per 1,000 samples"
    )
    return s


if __name__ == "__main__":
    sys.exit(main())
