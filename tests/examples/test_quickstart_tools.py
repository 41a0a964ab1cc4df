"""``areal quickstart --task tools`` end to end (tier 2, slow): the command as a user runs it, with
overrides that shrink both stages to a few steps: the tiny model is built, SFT trains on the
calculator agent's worked conversations, GRPO runs the openai-client agent through
``workflow.type=agent``, and the summary reports the agent's held-out success before and after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from launch_harness import REPO  # on sys.path by tests/examples/conftest.py

RUN_TIMEOUT = 300.0  # seconds; ~1-2 min on a quiet 2-core machine
TINY_SFT = ["total_train_steps=3", "train_dataset.batch_size=4"]
TINY_GRPO = [
    "total_train_steps=2",
    "train_dataset.batch_size=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=8",
    "eval_gconfig.max_new_tokens=8",
    "rollout.max_concurrent_rollouts=4",
    "valid_dataset.arithmetic.n_test=4",
    "valid_dataset.batch_size=4",
    "evaluator.freq_steps=null",
    "actor.dynamic_sampling=false",  # 3-step SFT never succeeds: every group would be rejected
]


@pytest.mark.slow
def test_quickstart_tools_runs_sft_then_agent_grpo_and_summarizes(tmp_path):
    out = tmp_path / "qs"
    args = [sys.executable, "-m", "areal.cli", "quickstart", "--task", "tools", "--out", str(out)]
    args += [f"--sft={o}" for o in TINY_SFT] + [f"--grpo={o}" for o in TINY_GRPO]
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:  # past the deadline: the command and everything it started go
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, log[-3000:]
    conversations = [
        json.loads(line) for line in (out / "agent-sft.jsonl").read_text().splitlines()
    ]
    tool_calls = [
        c["messages"][2]["tool_calls"][0] for c in conversations if "tool_calls" in c["messages"][2]
    ]
    assert len(conversations) == 5000 and all(
        call["function"]["name"] == "calc" for call in tool_calls
    )
    assert (
        1800 <= len(tool_calls) <= 2200
    )  # the 40% that use the tool (the rest answer in the head)
    assert (out / "sft" / "run" / "checkpoints" / "model" / "step3").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "tools" and summary["rl_steps"] == 2
    for key in ("acc_before", "acc_after"):
        assert summary[key] in (0.0, 0.25, 0.5, 0.75, 1.0), (
            summary
        )  # the agent's success on 4 problems
    assert "held-out agent success rate" in log
