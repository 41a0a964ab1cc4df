"""End-to-end RL throughput: our async GRPO stage vs a synchronous GRPO baseline, same machine.

Run (after ``make demo``, whose SFT checkpoint both sides start from):
``python bench/e2e.py [--steps 100] [--sft DIR] [--baseline trl|sync] [--out runs/bench_e2e]``.

Both sides train the demo's task (two-digit addition, 2000 prompts) from the same SFT model with
the same settings: 8 prompts x 8 samples per step, <= 6 new tokens, temperature 1, lr 1e-4
constant, no weight decay, grad clip 1, group-normalised rewards, clip 0.2 / 0.28, token-mean
loss, no KL, no dynamic sampling (the baseline has none), areal's ``math_reward``, 2 cores.

- ours: ``examples/gsm8k_grpo.py`` + ``examples/arithmetic_grpo.yaml`` through ``areal launch
  local`` (async, ``max_staleness=1``, server and trainer one core each);
- baseline ``trl``: TRL's ``GRPOTrainer`` (``bench/trl_grpo.py``), synchronous, both cores, in a
  bench-only venv ``bench/.venv-trl`` this script creates (``pip install trl math-verify`` over
  the same torch build); ``sync``: our own stack with ``rollout.max_staleness=0`` (used when
  TRL cannot be installed; the output says which ran).

Held-out greedy accuracy (200 problems) of the SFT model and of each side's final model is
measured by one evaluator (our generator, greedy, ``math_reward``). Prints s/step (median over
steps after the first 3), trained samples/s, the gains and the ratio, and our per-stage
breakdown after and before the throughput levers (``--before-steps`` steps with the separate
proximal-logp pass, no shared-prefix training and one prefill per request in the server), and
writes ``OUT/e2e.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VENV = REPO / "bench" / ".venv-trl"
GRPO_YAML = REPO / "examples" / "arithmetic_grpo.yaml"
SAME = [
    "actor.dynamic_sampling=false",
    "valid_dataset=null",
    "saver.freq_steps=null",
    "launcher.echo=false",
]
LEVERS_OFF = [
    "actor.prox_logp=recompute_always",
    "actor.shared_prefix=false",
    "server.share_prompts=false",
]


def _run(cmd: list[str], log: Path, timeout: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout
        ).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[:4]} failed with exit code {code}; last lines of {log}:\n{tail}")


def ensure_trl_venv() -> str | None:
    """The TRL venv's python, creating it if needed; None (with the reason printed) if it fails."""
    py = TRL_VENV / "bin" / "python"
    try:
        if not (TRL_VENV / ".installed").exists():
            print(f"[e2e] creating {TRL_VENV} (torch==2.13.0, trl, math-verify) ...", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
            pip = [str(py), "-m", "pip", "install", "-q"]
            subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=1800)
            subprocess.run([*pip, "trl", "math-verify"], check=True, timeout=1800)
            (TRL_VENV / ".installed").touch()
        subprocess.run([str(py), "-c", "import trl"], check=True, capture_output=True, timeout=300)
        return str(py)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"[e2e] TRL is unavailable ({e}); the baseline is our own sync mode", flush=True)
        return None


def task_items(sft: str) -> tuple[list[dict], list[dict]]:
    """The demo's train and held-out items (prompt ids, chat-templated text, reference)."""
    from transformers import AutoTokenizer

    from areal.api.config import GRPOConfig, load_config
    from areal.dataset import load_dataset
    from areal.dataset.chat import chat_text

    cfg = load_config(GRPOConfig, ["--config", str(GRPO_YAML), f"actor.path={sft}"])
    tok = AutoTokenizer.from_pretrained(sft)

    def items(dcfg) -> list[dict]:
        return [
            {
                "prompt_ids": it["prompt_ids"],
                "reference": it["reference"],
                "prompt": chat_text(tok, it["messages"], add_generation_prompt=True),
            }
            for it in load_dataset(dcfg, tok, cfg.seed)
        ]

    return items(cfg.train_dataset), items(cfg.valid_dataset)


def held_out_accuracy(model_dir: str, items: list[dict]) -> float:
    """Greedy accuracy on ``items``: our generator (greedy equals HF generate) + math_reward."""
    from transformers import AutoTokenizer

    from areal.reward.math import math_reward
    from areal.serving.generator import Generator
    from areal.serving.sampling import SamplingParams

    gen = Generator.from_pretrained(model_dir, max_batch_size=64).start()
    try:
        results = gen.generate(
            [it["prompt_ids"] for it in items], SamplingParams(max_new_tokens=6, temperature=0.0)
        )
    finally:
        gen.shutdown()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return sum(
        math_reward(tok.decode(r.output_ids, skip_special_tokens=True), it["reference"])
        for r, it in zip(results, items)
    ) / len(items)


def run_ours(sft: str, out: Path, steps: int, extra: list[str]) -> tuple[list[float], dict, str]:
    """Our GRPO stage; (per-step seconds, mean stage times, final HF dir)."""
    cmd = [
        sys.executable,
        "-m",
        "areal.cli",
        "launch",
        "local",
        "examples/gsm8k_grpo.py",
        "--config",
        str(GRPO_YAML),
        f"fileroot={out}",
        "experiment_name=grpo",
        "trial_name=run",
        f"actor.path={sft}",
        f"total_train_steps={steps}",
        *SAME,
        *extra,
    ]
    _run(cmd, out / "launch.log", timeout=3600)
    rows = [
        json.loads(line) for line in (out / "grpo" / "run" / "stats.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if r["step"] > 3]
    stages = {
        k: statistics.mean(r.get(k, 0.0) for r in rows) for k in rows[0] if k.startswith("timing/")
    }
    return (
        [r["perf/step_seconds"] for r in rows],
        stages,
        str(out / "grpo" / "run" / "checkpoints" / "actor" / f"step{steps}"),
    )


def run_trl(py: str, sft: str, out: Path, steps: int, train: list[dict]) -> tuple[list[float], str]:
    """TRL's GRPOTrainer; (per-step seconds, final model dir)."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "train.json"
    data.write_text(
        json.dumps([{"prompt": it["prompt"], "reference": it["reference"]} for it in train])
    )
    cmd = [
        py,
        str(REPO / "bench" / "trl_grpo.py"),
        "--model",
        sft,
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--lr",
        "1e-4",
        "--prompts",
        "8",
        "--n-samples",
        "8",
        "--max-new-tokens",
        "6",
        "--temperature",
        "1.0",
        "--eps-clip",
        "0.2",
        "--eps-clip-higher",
        "0.28",
        "--threads",
        "2",
        "--seed",
        "1",
    ]
    _run(cmd, out / "trl.log", timeout=3600)
    result = json.loads((out / "trl_result.json").read_text())
    return result["step_seconds"][3:], str(out / "final")


def _stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('timing/')} {v:.3f}" for k, v in stages.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sft",
        default=str(REPO / "runs/quickstart/sft/run/checkpoints/model/step300"),
        help="SFT checkpoint both sides start from (make demo writes it)",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--baseline", choices=["trl", "sync"], default="trl")
    p.add_argument("--out", default=str(REPO / "runs" / "bench_e2e"))
    p.add_argument(
        "--before-steps",
        type=int,
        default=20,
        help="steps of our stack with the throughput levers off (0 = skip)",
    )
    a = p.parse_args()
    if not Path(a.sft, "config.json").is_file():
        raise SystemExit(
            f"--sft {a.sft} is not an HF model dir; run `make demo` first or pass --sft DIR"
        )
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    train, valid = task_items(a.sft)
    py = ensure_trl_venv() if a.baseline == "trl" else None
    baseline = "trl" if py else "sync"
    print(f"[e2e] {a.steps} steps each from {a.sft}; baseline: {baseline}", flush=True)
    ours_steps, stages, ours_model = run_ours(a.sft, out / "areal", a.steps, [])
    if py:
        base_steps, base_model = run_trl(py, a.sft, out / "trl", a.steps, train)
    else:
        base_steps, _, base_model = run_ours(
            a.sft, out / "sync", a.steps, ["rollout.max_staleness=0"]
        )
    before = None
    if a.before_steps:
        steps_before, stages_before, _ = run_ours(a.sft, out / "before", a.before_steps, LEVERS_OFF)
        before = {"s_per_step": statistics.median(steps_before), "stage_seconds": stages_before}
    acc = {
        name: held_out_accuracy(m, valid)
        for name, m in (("sft", a.sft), ("ours", ours_model), ("baseline", base_model))
    }
    s_ours, s_base = statistics.median(ours_steps), statistics.median(base_steps)
    result = {
        "baseline": baseline,
        "steps": a.steps,
        "ours_s_per_step": s_ours,
        "baseline_s_per_step": s_base,
        "ours_samples_per_s": 64 / s_ours,
        "baseline_samples_per_s": 64 / s_base,
        "ratio": s_base / s_ours,
        "acc_sft": acc["sft"],
        "acc_ours": acc["ours"],
        "acc_baseline": acc["baseline"],
        "gain_ours": acc["ours"] - acc["sft"],
        "gain_baseline": acc["baseline"] - acc["sft"],
        "ours_stage_seconds": stages,
        "ours_before_levers": before,
    }
    (out / "e2e.json").write_text(json.dumps(result, indent=2))
    print(
        f"[e2e] ours {s_ours:.3f} s/step ({64 / s_ours:.1f} samples/s), "
        f"{baseline} {s_base:.3f} s/step "
        f"({64 / s_base:.1f} samples/s): ratio {s_base / s_ours:.2f}x\n"
        f"[e2e] held-out greedy accuracy: SFT {acc['sft']:.3f}, ours {acc['ours']:.3f} "
        f"({result['gain_ours'] * 100:+.1f} points), {baseline} {acc['baseline']:.3f} "
        f"({result['gain_baseline'] * 100:+.1f} points)\n"
        f"[e2e] our stages (s/step): " + _stages(stages)
    )
    if before is not None:
        print(
            f"[e2e] before the levers: {before['s_per_step']:.3f} s/step; stages: "
            + _stages(before["stage_seconds"])
        )
    print(f"[e2e] {out / 'e2e.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
