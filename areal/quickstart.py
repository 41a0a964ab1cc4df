"""``areal quickstart``: the embedded demo on one CPU machine with no network.

1. builds the tiny model (``OUT/model``);
2. SFT-warms it on synthetic arithmetic (``examples/sft.py`` through the local launcher);
3. runs asynchronous GRPO through the real stack: the local launcher, our generation server as a
   separate process over HTTP, the FSDP2 trainer over gloo under torchrun, a weight update every
   step, ``rollout.max_staleness`` > 0 (``examples/gsm8k_grpo.py`` +
   ``examples/arithmetic_grpo.yaml``);
4. reads held-out greedy accuracy before (step 0: the SFT model) and after, prints a summary,
   writes ``OUT/plot.png`` and ``OUT/summary.json``.

``--task tools`` runs the same stages on the calculator agent (``examples/agent_arithmetic.py``, a
plain openai-client agent): SFT on worked conversations, most of which answer in the head and
the rest with the tool, then GRPO, which learns when the tool pays through the in-process
OpenAI client (``examples/agent_arithmetic.yaml``, ``workflow.type: agent``).

The entry scripts are the repository's ``examples/`` (next to the ``areal`` package in a source
checkout, which is what ``make demo`` installs).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import areal
from areal.launcher.local import launch_local
from areal.utils.plot import plot_run, read_stats
from areal.utils.tiny_model import build_tiny_model, count_parameters

INTERRUPTED = 130  # the launcher's exit code after Ctrl-C or SIGTERM
TARGET_GAIN = 0.15  # held-out accuracy points GRPO should add over the SFT model


def _examples_dir() -> Path:
    path = Path(areal.__file__).resolve().parents[1] / "examples"
    if not (path / "gsm8k_grpo.py").is_file():
        raise FileNotFoundError(
            f"{path} has no entry scripts: quickstart runs from a source checkout "
            "(`pip install -e .` or `make demo` in the repository)"
        )
    return path


def _launch(script: Path, config: Path, overrides: list[str]) -> None:
    code = launch_local(str(script), ["--config", str(config), *overrides])
    if code == INTERRUPTED:  # Ctrl-C / SIGTERM: the launcher stopped everything and said so
        raise SystemExit(code)
    if code != 0:
        raise RuntimeError(f"{script.name} failed with exit code {code}; see the logs above")


def _last_checkpoint(run_dir: Path, name: str) -> Path:
    steps = sorted((run_dir / "checkpoints" / name).glob("step*"), key=lambda p: int(p.name[4:]))
    if not steps:
        raise FileNotFoundError(f"no HF checkpoint under {run_dir / 'checkpoints' / name}")
    return steps[-1]


def summarize(
    rows: list[dict], wall_seconds: float, rl_seconds: float, samples_per_step: int
) -> dict:
    """Summary numbers from the GRPO run's stats rows."""
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        raise RuntimeError(
            "the GRPO run logged no step-0 and final evaluation; is valid_dataset set?"
        )
    steps = [r for r in rows if r["step"] > 0]
    return {
        "acc_before": evals[0]["eval/accuracy"],
        "acc_after": evals[-1]["eval/accuracy"],
        "wall_seconds": wall_seconds,
        "rl_seconds": rl_seconds,
        "rl_steps": len(steps),
        "samples_per_second": len(steps) * samples_per_step / rl_seconds,
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in steps) / max(len(steps), 1),
        "staleness_max": max((r.get("staleness/max", 0.0) for r in steps), default=0.0),
        "reward_first": steps[0]["reward/mean"] if steps else None,
        "reward_last": steps[-1]["reward/mean"] if steps else None,
    }


TASKS = ("arithmetic", "tools")


def _load_example(path: Path):
    """Import an example module from its file (the examples are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sft_tools_data(examples: Path, model: Path, out: Path, n: int) -> Path:
    """Write ``n`` worked calculator conversations (examples/agent_arithmetic.py) as SFT data."""
    from transformers import AutoTokenizer

    agent = _load_example(examples / "agent_arithmetic.py")
    path = out / "agent-sft.jsonl"
    with open(path, "w") as f:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        for row in agent.sft_conversations(tokenizer, n, agent.SFT_GUESS_FRACTION):
            f.write(json.dumps(row) + "\n")
    return path


def _stages(task: str, examples: Path, model: Path, out: Path, n_sft: int) -> tuple[list, list]:
    """(script, config, overrides) of the SFT stage and of the GRPO stage (less actor.path)."""
    if task == "arithmetic":
        return ([examples / "sft.py", examples / "sft_arithmetic.yaml", [f"model.path={model}"]],
                [examples / "gsm8k_grpo.py", examples / "arithmetic_grpo.yaml", []])  # fmt: skip
    if task == "tools":
        data = _sft_tools_data(examples, model, out, n_sft)
        return ([examples / "sft.py", examples / "agent_arithmetic_sft.yaml",
                 [f"model.path={model}", f"train_dataset.path={data}"]],
                [examples / "gsm8k_grpo.py", examples / "agent_arithmetic.yaml", []])  # fmt: skip
    raise ValueError(f"quickstart --task {task!r} is not one of {list(TASKS)}")


def _device_overrides() -> list[str]:
    """On a GPU machine the server generates on the GPU too: with one GPU the launcher puts it on
    the trainer's (cluster.colocate) and the server gives back its KV cache while the trainer
    steps. Nothing on CPU machines."""
    import torch

    if not torch.cuda.is_available():
        return []
    print(
        f"[quickstart] GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}; the "
        "generation server runs on cuda (on one GPU, colocated with the trainer)"
    )
    shm = Path("/dev/shm")  # weight updates through memory, not the disk
    return [
        "server.device=cuda",
        *([f"weight_update_dir={shm / 'areal-quickstart'}"] if shm.is_dir() else []),
    ]


def run_quickstart(
    out: str | Path, task: str = "arithmetic", sft_overrides: list[str] = (),
    grpo_overrides: list[str] = (), n_sft: int = 5000,
) -> int:  # fmt: skip
    """Run the whole demo of ``task`` into ``out``; returns 0 when every stage ran.

    ``arithmetic``: SFT then GRPO on arithmetic answered directly. ``tools``: the calculator
    agent (examples/agent_arithmetic.py, plain openai client): SFT on ``n_sft`` worked
    conversations (40% call the tool, the rest answer in the head), then GRPO with
    ``workflow.type=agent``; accuracy is the agent's own reward.
    ``*_overrides`` (key=value) go after the stage's YAML (shorter runs in tests)."""
    from areal.api.config import GRPOConfig, load_config

    if task not in TASKS:
        raise ValueError(f"quickstart --task {task!r} is not one of {list(TASKS)}")
    start = time.time()
    out = Path(out).resolve()
    examples = _examples_dir()
    for stale in ("sft", "grpo", "model"):
        shutil.rmtree(out / stale, ignore_errors=True)
    model = build_tiny_model(out / "model", size="tiny", seed=0)
    print(
        f"[quickstart] task {task}; tiny model: {count_parameters(model):,} parameters at {model}"
    )

    common = [f"fileroot={out}", "trial_name=run"]
    sft, grpo = _stages(task, examples, model, out, n_sft)
    _launch(sft[0], sft[1], [*common, "experiment_name=sft", *sft[2], *sft_overrides])
    sft_model = _last_checkpoint(out / "sft" / "run", "model")
    print(f"[quickstart] SFT done: {sft_model}")

    rl_start = time.time()
    grpo_args = [
        *common,
        "experiment_name=grpo",
        f"actor.path={sft_model}",
        *grpo[2],
        *_device_overrides(),
        *grpo_overrides,
    ]
    _launch(grpo[0], grpo[1], grpo_args)
    rl_seconds = time.time() - rl_start
    cfg = load_config(GRPOConfig, ["--config", str(grpo[1]), *grpo_args])
    rows = read_stats(cfg.run_dir)
    samples_per_step = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    summary = summarize(rows, time.time() - start, rl_seconds, samples_per_step)
    summary["task"] = task
    summary["plot"] = str(plot_run(cfg.run_dir, out / "plot.png"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary, out)
    return 0


def areal_command(path_env: str | None = None) -> str:
    """How the user's shell runs this ``areal``: ``areal`` when the shell's PATH finds this
    installation's script (an activated venv), else its path, e.g. ``.venv/bin/areal`` after
    ``make demo`` (which installs into .venv without activating it)."""
    script = Path(sys.executable).parent / "areal"
    found = shutil.which("areal", path=os.environ.get("PATH") if path_env is None else path_env)
    if found and Path(found).resolve() == script.resolve():
        return "areal"
    try:
        return os.path.relpath(script)
    except ValueError:  # another drive (Windows)
        return str(script)


def _print_summary(summary: dict, out: Path) -> None:
    gain = summary["acc_after"] - summary["acc_before"]
    what = "agent success rate" if summary["task"] == "tools" else "greedy accuracy"
    print(
        f"\n[quickstart] held-out {what} {summary['acc_before']:.3f} (SFT) -> "
        f"{summary['acc_after']:.3f} (after {summary['rl_steps']} async GRPO steps): "
        f"{gain * 100:+.1f} points (target +{TARGET_GAIN * 100:.0f}: "
        f"{'met' if gain >= TARGET_GAIN else 'NOT met'})\n"
        f"[quickstart] wall {summary['wall_seconds']:.0f} s total, "
        f"GRPO {summary['rl_seconds']:.0f} s, "
        f"{summary['samples_per_second']:.1f} samples/s, staleness mean "
        f"{summary['staleness_mean']:.2f} max {summary['staleness_max']:.0f}\n"
        f"[quickstart] {out / 'summary.json'}, {summary['plot']}\n"
        f"[quickstart] every trained sample, in the browser: "
        f"{areal_command()} view {out / 'grpo' / 'run'}"
    )
