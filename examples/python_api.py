"""Training from Python, without copying an entry script: SFT, then GRPO, configured in code.

Run: ``python examples/python_api.py --out runs/python-api`` (builds the tiny model; or
``--model DIR`` for a local Qwen2-family model). On 2 CPU cores the defaults take ~5 minutes.

The configs are the same typed dataclasses the YAML files fill: :func:`from_dict` builds one from
a nested dict and checks it at once (every problem reported with its field path, as
``--config`` does), :func:`dataclasses.replace` changes a built one. :func:`launch_local` runs an
entry script under the local launcher exactly as ``areal launch local`` does (generation servers,
torchrun trainers, relaunch on failure), given the config saved as YAML with :func:`save_config`.
The entry scripts are this directory's ``sft.py`` and ``gsm8k_grpo.py``, used as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from areal.api.config import GRPOConfig, SFTConfig, from_dict, save_config
from areal.launcher.local import launch_local
from areal.utils.plot import read_stats
from areal.utils.tiny_model import build_tiny_model

EXAMPLES = Path(__file__).resolve().parent
# Two-digit addition, 200 held-out problems: the embedded demo's task (sft_arithmetic.yaml).
ARITHMETIC = {
    "min_digits": 2,
    "max_digits": 2,
    "operators": "+",
    "n_train": 2000,
    "n_test": 200,
    "test_percent": 10,
}


def _data(kind: str, batch_size: int) -> tuple[dict, dict]:
    """(train, held-out) dataset sections of one kind (``sft`` or ``rl``)."""
    train = {"type": kind, "path": "arithmetic", "batch_size": batch_size, "arithmetic": ARITHMETIC}
    valid = {**train, "split": "test", "batch_size": 200, "shuffle": False, "drop_last": False}
    return train, valid


def sft_config(model: str, out: Path, steps: int) -> SFTConfig:
    """SFT on arithmetic for ``steps`` steps; the last step's HF checkpoint is the result."""
    train, valid = _data("sft", 32)
    return from_dict(SFTConfig, {
        "experiment_name": "sft", "trial_name": "run", "fileroot": str(out),
        "total_train_epochs": 10, "total_train_steps": steps,
        "model": {"path": model, "optimizer": {"lr": 1e-3, "weight_decay": 0.0,
                                               "warmup_steps_proportion": 0.04}},
        "train_dataset": train, "valid_dataset": valid,
        "evaluator": {"freq_steps": steps}, "stats_logger": {"console": False},
    })  # fmt: skip


def grpo_config(model: str, out: Path, steps: int) -> GRPOConfig:
    """Asynchronous GRPO (one version of staleness) on one CPU server and one trainer rank."""
    train, valid = _data("rl", 8)
    return from_dict(GRPOConfig, {
        "experiment_name": "grpo", "trial_name": "run", "fileroot": str(out),
        "total_train_epochs": 100, "total_train_steps": steps,
        "cluster": {"n_servers": 1, "trainer_nprocs": 1},
        "launcher": {"server_threads": 1, "trainer_threads": 1},
        "actor": {"path": model, "algorithm": "grpo", "use_decoupled_loss": True,
                  "optimizer": {"lr": 1e-4, "weight_decay": 0.0}},
        "gconfig": {"n_samples": 8, "max_new_tokens": 6},
        "rollout": {"max_staleness": 1, "max_concurrent_rollouts": 16},
        "reward": {"n_workers": 1},  # the default arithmetic reward: cheap
        "train_dataset": train, "valid_dataset": valid,
        "evaluator": {"freq_steps": steps}, "stats_logger": {"console": False},
    })  # fmt: skip


def run(script: str, cfg) -> Path:
    """Save ``cfg`` beside its run and launch ``script`` on it; RUN_DIR once it exited 0."""
    path = save_config(cfg, Path(cfg.fileroot) / f"{cfg.experiment_name}.yaml")
    code = launch_local(str(EXAMPLES / script), ["--config", str(path)])
    if code != 0:
        raise RuntimeError(
            f"{script} exited with {code}; its logs are under {cfg.run_dir / 'logs'}"
        )
    return cfg.run_dir


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/python-api", help="fileroot of both runs")
    ap.add_argument("--model", help="HF model dir to start from (default: a new tiny model)")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--grpo-steps", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="a seconds-long smoke run (tests)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    model = args.model or str(build_tiny_model(out / "model"))

    sft = sft_config(model, out, args.sft_steps)
    if args.small:  # smaller batches: a change to a built config is a dataclasses.replace
        sft = dataclasses.replace(
            sft, train_dataset=dataclasses.replace(sft.train_dataset, batch_size=8)
        )
    sft_dir = run("sft.py", sft)
    sft_model = sft_dir / "checkpoints" / "model" / f"step{args.sft_steps}"

    grpo = grpo_config(str(sft_model), out, args.grpo_steps)
    if args.small:
        grpo = dataclasses.replace(
            grpo,
            gconfig=dataclasses.replace(grpo.gconfig, n_samples=4, max_new_tokens=4),
            eval_gconfig=dataclasses.replace(grpo.eval_gconfig, max_new_tokens=4),
            train_dataset=dataclasses.replace(grpo.train_dataset, batch_size=2),
            valid_dataset=dataclasses.replace(grpo.valid_dataset, size=16),
        )
    grpo_dir = run("gsm8k_grpo.py", grpo)
    evals = [r for r in read_stats(grpo_dir) if "eval/accuracy" in r]
    print(
        f"held-out accuracy {evals[0]['eval/accuracy']:.3f} (after SFT) -> "
        f"{evals[-1]['eval/accuracy']:.3f} (after {args.grpo_steps} GRPO steps); runs under {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
