"""The synchronous GRPO baseline of ``bench/e2e.py``: TRL's ``GRPOTrainer`` on the demo's task.

Runs inside the bench-only venv ``bench/.venv-trl`` that ``bench/e2e.py`` creates (TRL is never a
dependency of ``areal`` or of its tests). It reads the prompts and references ``bench/e2e.py``
wrote, scores completions with areal's own ``math_reward`` (stdlib + math-verify, imported from
the source tree), trains for ``--steps`` steps and writes the per-step wall times and the final
model under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # areal.reward.math only

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from areal.reward.math import math_reward  # noqa: E402


class StepTimes(TrainerCallback):
    """Wall time of every optimizer step (generation, reward, logp and update included)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now


def main() -> int:
    p = argparse.ArgumentParser()
    for name, kind in (
        ("model", str),
        ("data", str),
        ("out", str),
        ("steps", int),
        ("lr", float),
        ("prompts", int),
        ("n_samples", int),
        ("max_new_tokens", int),
        ("temperature", float),
        ("eps_clip", float),
        ("eps_clip_higher", float),
        ("threads", int),
        ("seed", int),
    ):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = json.loads(Path(a.data).read_text())
    data = Dataset.from_list([{"prompt": r["prompt"], "reference": r["reference"]} for r in rows])

    def reward(prompts, completions, reference, **kwargs):
        return [math_reward(c, r) for c, r in zip(completions, reference)]

    cfg = GRPOConfig(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=a.prompts * a.n_samples,
        num_generations=a.n_samples,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip_higher,
        loss_type="dapo",
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=a.seed,
        dataloader_num_workers=0,
    )
    timer = StepTimes()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(str(Path(a.out) / "final"))
    tokenizer.save_pretrained(str(Path(a.out) / "final"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    Path(a.out, "trl_result.json").write_text(
        json.dumps({"step_seconds": timer.times, "rewards": rewards})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
