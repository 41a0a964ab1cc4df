"""``areal eval --model DIR [--config YAML] [overrides]``: held-out accuracy of a checkpoint, no
training.

Starts one generation server on DIR (a child process, stopped at the end), samples
``eval_gconfig`` completions for every item of ``valid_dataset`` through the same workflow and
reward a training run's evaluation uses (``reward_fn``, ``workflow``), and reports the mean
reward: with a 0/1 reward the fraction judged correct. Takes the training config (a GRPO YAML),
so ``areal eval --model RUN_DIR/checkpoints/actor/step200 --config examples/arithmetic_grpo.yaml``
measures what that run's ``eval/accuracy`` measured.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from areal.api.config import ConfigError, GRPOConfig, load_config
from areal.api.launch import api_key_env, threads_env
from areal.dataset import load_dataset
from areal.launcher.plan import launch_plan
from areal.launcher.procs import ProcessSupervisor
from areal.launcher.servers import ManagedServer
from areal.reward.resolve import resolve_reward
from areal.reward.runner import RewardRunner
from areal.rollout.executor import WorkflowExecutor
from areal.rollout.remote import RemoteInferenceEngine
from areal.runtime.preflight import model_dir_problem, preflight
from areal.utils.network import free_port
from areal.workflow.rlvr import RLVRWorkflow


def run_eval(model: str, argv: list[str]) -> dict[str, Any]:
    """Evaluate ``model`` on the config's held-out data; the summary (see the module docstring)."""
    from transformers import AutoTokenizer

    scratch = tempfile.mkdtemp(
        prefix="areal-eval-"
    )  # the server's logs; the run dirs stay untouched
    problem = model_dir_problem("--model", model)  # named as the user gave it, not actor.path
    if problem:
        raise ConfigError([problem], "areal eval")
    base = ["actor.use_critic=false", "cluster.n_servers=1", "rollout.max_staleness=0"]
    cfg = load_config(GRPOConfig, [*base, *argv, f"actor.path={model}", f"fileroot={scratch}"])
    problems = preflight(cfg)
    if cfg.valid_dataset is None:
        problems.append(
            "valid_dataset: null; areal eval needs held-out data (set valid_dataset.path)"
        )
    if problems:
        raise ConfigError(problems, "areal eval")
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or model)
    items = list(load_dataset(cfg.valid_dataset, tokenizer, cfg.seed))
    lc = cfg.launcher
    with ProcessSupervisor(Path(scratch) / "logs", echo=False, stop_timeout=lc.stop_timeout) as sup:
        env = {**threads_env(lc.server_threads), **api_key_env(cfg.server.api_key)}
        server = ManagedServer.start(sup, cfg, launch_plan(cfg).role("server0"), free_port(), env)
        sup.wait_http_ok(server.child, f"{server.url}/health", lc.server_setup_timeout)
        engine = RemoteInferenceEngine(cfg.rollout, api_key=cfg.server.api_key)
        engine.initialize([server.address])
        executor = WorkflowExecutor(cfg.rollout, engine, batch_size=1)
        executor.initialize()
        try:
            with RewardRunner(resolve_reward(cfg.reward_fn), cfg.reward) as reward:
                groups = executor.rollout_batch(
                    items, RLVRWorkflow(reward, cfg.eval_gconfig, tokenizer)
                )
                failures = reward.commit_batch()
        finally:
            executor.destroy()
            engine.destroy()
    shutil.rmtree(scratch, ignore_errors=True)  # kept when the evaluation failed: its logs
    rewards = [t.reward for g in groups for t in g]
    return {
        "model": model,
        "dataset": cfg.valid_dataset.path,
        "split": cfg.valid_dataset.split,
        "n_items": len(items),
        "n_samples": len(rewards),
        "accuracy": sum(rewards) / len(rewards) if rewards else math.nan,
        "greedy": cfg.eval_gconfig.greedy,
        "reward_fn": cfg.reward_fn,
        "reward_failures": int(failures.get("reward/n_failed", 0)),
    }


def main(model: str, argv: list[str], out: str | None) -> int:
    """Print the summary as JSON (and write it to ``out``)."""
    summary = run_eval(model, argv)
    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
