"""The GPU check (``make gpu-check``, run by ``bench/gpu_check.sh`` after it installs the carried
wheels): on one GPU, in a few minutes, the tier-3 tests, every entry point for a few steps, and
the GPU bench (``bench/gpu.py``); one summary table and ``OUT/gpu_check.json``.

Each step is a subprocess with its own deadline and log (``OUT/logs/<step>.log``); a failed step
is recorded with the last line of its output and the others still run. The functional steps run
``--jobs`` at a time; the timing step (``bench_gpu``) runs after them, alone on the GPU. Exit 0
only when every step passed. Runs unchanged on an H100 and an H200; nothing here needs the network.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
AREAL = [sys.executable, "-m", "areal.cli"]
SHORT_RL = [
    "actor.dynamic_sampling=false",
    "train_dataset.batch_size=4",
    "gconfig.n_samples=4",
    "gconfig.max_new_tokens=16",
    "eval_gconfig.max_new_tokens=16",
    "rollout.max_concurrent_rollouts=16",
    "valid_dataset.arithmetic.n_test=16",
    "valid_dataset.batch_size=16",
    "server.device=cuda",
]
SHORT_LM = ["total_train_steps=4", "train_dataset.batch_size=8", "evaluator.freq_steps=null"]
PAIRS = [
    "path=arithmetic",
    "arithmetic.max_digits=1",
    "arithmetic.operators=+",
    "arithmetic.n_train=40",
    "arithmetic.n_test=8",
    "arithmetic.test_percent=20",
]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: float  # seconds
    run_dir: str = ""  # where its stats.jsonl lands (figures for the table)
    alone: bool = False  # a timing step: runs after the others, with the GPU to itself
    result: dict = field(default_factory=dict)


def steps(out: Path, model: Path) -> list[Step]:
    """Every step of the check, in order; ``model`` is the tiny model the entry points train."""

    def launch(name: str, script: Path, config: Path, *overrides: str, timeout: float = 90) -> Step:
        common = [f"fileroot={out / 'runs'}", f"experiment_name={name}", "trial_name=t"]
        return Step(
            name,
            [*AREAL, "launch", "local", str(script), "--config", str(config), *common, *overrides],
            timeout,
            str(out / "runs" / name / "t"),
        )

    grpo = [f"actor.path={model}", *SHORT_RL, "total_train_steps=5", "rollout.max_staleness=1"]
    return [
        Step(  # first: the longest step (SFT 300 steps, then GRPO 150 steps colocated)
            "quickstart",
            [*AREAL, "quickstart", "--out", str(out / "quickstart")],
            420,
            str(out / "quickstart" / "grpo" / "run"),
        ),
        Step(
            "tier3_tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-q",
                "-p",
                "no:cacheprovider",
                str(ROOT / "tests"),
            ],
            180,
        ),
        launch("sft", EX / "sft.py", EX / "sft_arithmetic.yaml", f"model.path={model}", *SHORT_LM),
        launch("rm", EX / "rm.py", EX / "rm.yaml", f"model.path={model}", *SHORT_LM),
        launch(
            "dpo",
            EX / "dpo.py",
            EX / "dpo_arithmetic.yaml",
            f"model.path={model}",
            *SHORT_LM,
            *[f"{s}_dataset.{a}" for s in ("train", "valid") for a in PAIRS],
            "valid_dataset.split=test",
        ),
        launch(
            "grpo_colocated", EX / "gsm8k_grpo.py", EX / "arithmetic_grpo.yaml", *grpo, timeout=120
        ),
        launch(
            "agent",
            EX / "gsm8k_grpo.py",
            EX / "agent_arithmetic.yaml",
            f"actor.path={model}",
            *SHORT_RL,
            "total_train_steps=2",
            timeout=120,
        ),
        Step(
            "python_api",
            [
                sys.executable,
                str(EX / "python_api.py"),
                "--out",
                str(out / "runs" / "python_api"),
                "--model",
                str(model),
                "--sft-steps",
                "2",
                "--grpo-steps",
                "1",
                "--small",
            ],
            150,
        ),
        Step(
            "core_sft",
            [
                *AREAL,
                "core",
                "sft",
                "--config",
                str(EX / "sft_arithmetic.yaml"),
                f"fileroot={out / 'runs'}",
                "experiment_name=core_sft",
                "trial_name=t",
                f"model.path={model}",
                *SHORT_LM,
            ],
            90,
            str(out / "runs" / "core_sft" / "t"),
        ),
        launch(
            "core_sync_ppo",
            ROOT / "areal" / "core" / "sync_ppo.py",
            EX / "arithmetic_grpo.yaml",
            f"actor.path={model}",
            *SHORT_RL,
            "total_train_steps=3",
            "rollout.max_staleness=0",
            timeout=120,
        ),
        Step(
            "bench_gpu",
            [
                sys.executable,
                str(ROOT / "bench" / "gpu.py"),
                "--out",
                str(out / "bench_gpu.json"),
                "--budget-s",
                "150",
            ],
            240,
            alone=True,
        ),
    ]


def last_stats(run_dir: str) -> dict:
    """The last stats row of a run (empty if it wrote none)."""
    path = Path(run_dir) / "stats.jsonl"
    if not run_dir or not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[-1] if rows else {}


def run_step(step: Step, logs: Path) -> None:
    """Run one step under its deadline (its whole process group killed past it)."""
    log = logs / f"{step.name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(step.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
            code = "timeout"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    stats = last_stats(step.run_dir)
    figure = {
        k: stats[k]
        for k in ("step", "loss/loss", "reward/mean", "eval/accuracy", "timing/step/total")
        if k in stats
    }
    step.result = {
        "passed": code == 0,
        "code": code,
        "seconds": round(time.monotonic() - start, 1),
        "last_line": lines[-1][:160] if lines else "",
        "figures": figure,
    }


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    p = torch.cuda.get_device_properties(0)
    memory = p.total_memory / 2**30  # GiB
    return f"{p.name}, {memory:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="areal's GPU check (see bench/gpu_check.sh)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"))
    ap.add_argument("--only", nargs="*", default=None, help="run only these steps")
    ap.add_argument(
        "--jobs", type=int, default=3, help="functional steps run side by side (timings alone)"
    )
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = out / "model"
    subprocess.run(
        [*AREAL, "tiny-model", "--out", str(model)], check=True, cwd=ROOT, capture_output=True
    )
    device = device_line()
    print(f"[gpu-check] {device}", flush=True)
    todo = [s for s in steps(out, model) if args.only is None or s.name in args.only]

    def run_and_say(step: Step) -> None:
        run_step(step, out / "logs")
        r = step.result
        print(
            f"[gpu-check] {step.name}: {'pass' if r['passed'] else 'FAIL'} in {r['seconds']} s "
            f"{r['figures'] or r['last_line']}",
            flush=True,
        )

    start = time.monotonic()
    # the functional steps side by side (each is small next to the GPU, 16 cores), then the
    # timing steps one at a time
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(run_and_say, [s for s in todo if not s.alone]))
    for step in todo:
        if step.alone:
            run_and_say(step)
    wall = round(time.monotonic() - start, 1)
    print("\n| step | result | seconds | figures / last line |\n| --- | --- | --- | --- |")
    for s in todo:
        r = s.result
        print(
            f"| {s.name} | {'pass' if r['passed'] else 'FAIL (' + str(r['code']) + ')'} "
            f"| {r['seconds']} | {r['figures'] or r['last_line']} |"
        )
    print(f"[gpu-check] {wall} s on {device}")
    (out / "gpu_check.json").write_text(
        json.dumps(
            {"device": device, "wall_seconds": wall, "steps": [asdict(s) for s in todo]}, indent=2
        )
    )
    return 0 if all(s.result["passed"] for s in todo) else 1


if __name__ == "__main__":
    sys.exit(main())
