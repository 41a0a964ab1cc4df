"""Tier 2 with a real vLLM server: async GRPO through ``areal launch local`` with
``rollout.backend=vllm``, the server started by the launcher from the vLLM venv's Python
(``rollout.vllm_python``; tests/vllm_env.py). A few steps: rewards are computed from vLLM's
samples, every step's weights reach the server by a disk reload, and training runs on them.
A longer run (30 steps from an SFT-warmed model) is measured outside the tests: docs/vllm.md.
"""

from __future__ import annotations

import re

import pytest
from conftest import GRPO_SCRIPT, GRPO_YAML, SMALL_RL

from launch_harness import assert_finite, train_steps
from tests import vllm_env

pytestmark = pytest.mark.slow
RUN_TIMEOUT = 900.0  # seconds: vLLM's start (~30 s idle, minutes on a loaded 2-core box) + 3 steps


def test_async_grpo_on_a_launcher_started_vllm_server_updates_its_weights_every_step(
    launcher, tiny_model_dir, monkeypatch
):
    python, reason = vllm_env.wait_built()  # `make test` builds it beside the tests
    if python is None:
        pytest.skip(reason)
    for key, value in vllm_env.SERVER_ENV.items():  # the launcher passes its env to servers
        monkeypatch.setenv(key, value)
    n_steps = 3
    overrides = [
        f"actor.path={tiny_model_dir}",
        *SMALL_RL,
        f"total_train_steps={n_steps}",
        "rollout.max_staleness=1",
        "valid_dataset=null",
        "rollout.backend=vllm",
        "rollout.served_model_name=tiny",
        f"rollout.vllm_python={python}",
        f"rollout.vllm_args={vllm_env.SERVER_ARGS}",
        f"launcher.server_setup_timeout={vllm_env.READY_DEADLINE}",
    ]
    run, run_dir = launcher.start("vllm-grpo", GRPO_SCRIPT, GRPO_YAML, overrides)
    code = run.wait(RUN_TIMEOUT)
    server_log = run_dir / "logs" / "server0.log"
    log = server_log.read_text(errors="replace") if server_log.is_file() else "(no server log)"
    assert code == 0, f"exited with {code}:\n{run.output()}\nserver log:\n{log[-4000:]}"
    run.assert_no_survivors()
    stats = train_steps(run_dir)
    assert sorted(stats) == list(range(1, n_steps + 1)), sorted(stats)
    for step in stats:
        assert_finite(
            stats[step], ["reward/mean", "staleness/max", "loss/pg_loss", "loss/logp_mismatch"]
        )
        assert stats[step]["staleness/max"] <= 1
        if stats[step]["staleness/max"] == 0:  # every token from the trained weights: vLLM's
            assert stats[step]["loss/logp_mismatch"] < 1e-3  # logprobs are the trainer's (~1e-6)
    assert (
        "vllm.entrypoints.openai.api_server" in log and "--logprobs-mode processed_logprobs" in log
    )
    reloads = re.findall(r'"POST /collective_rpc HTTP/1.1" 200', log)
    assert len(reloads) >= n_steps - 1, log[-3000:]  # one disk reload per published version
    completions = re.findall(r'"POST /v1/completions HTTP/1.1" 200', log)
    assert len(completions) >= n_steps * 2 * 4  # every sample of every trained group came from vLLM
