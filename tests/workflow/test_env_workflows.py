"""The environment workflows (areal.workflow.envs) on scripted replies (tier 2, no server):
reasoning-gym's datasets and scorers, OpenEnv episodes in process and by address, and the
faults an environment may have, each failing its episode only."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import threading
from pathlib import Path

import pytest

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.data import DatasetConfig
from areal.api.config.reward import WorkflowConfig
from areal.dataset import load_dataset
from areal.dataset.envs import parse_tasks

pytest.importorskip("reasoning_gym", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("openenv", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("verifiers", reason="the envs extra: pip install -e '.[envs]'")

from areal.workflow.envs import make_env_workflow  # noqa: E402

# examples/openenv_guess.py and verifiers_tasks.py, imported as the launched runs do (beside the
# entry script)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

G = GenerationHyperparameters(n_samples=1, max_new_tokens=16, temperature=1.0)


def _run(wf, engine, item):
    return asyncio.run(wf.arun_episode(engine, item))


def test_reasoning_gym_mix_is_seeded_weighted_and_split_apart():
    cfg = DatasetConfig(path="reasoning_gym:chain_sum,leg_counting:3", size=8)
    items = load_dataset(cfg, seed=1)
    tasks = [it["reference"]["task"] for it in items]
    assert (tasks.count("chain_sum"), tasks.count("leg_counting")) == (2, 6)  # 8 x 1/4, 8 x 3/4
    assert [it["id"] for it in load_dataset(cfg, seed=1)] == [it["id"] for it in items]
    again = [it["messages"] for it in load_dataset(cfg, seed=1)]
    assert again == [it["messages"] for it in items]  # same seed, same questions
    test = load_dataset(DatasetConfig(path=cfg.path, size=8, split="test"), seed=1)
    assert [it["messages"] for it in test] != [it["messages"] for it in items]
    with pytest.raises(ValueError, match="with a positive weight"):
        parse_tasks("chain_sum:-1")
    assert parse_tasks("chain_sum(max_terms=2,max_digits=1):2,leg_counting") == [
        ("chain_sum", {"max_terms": 2, "max_digits": 1}, 2.0),
        ("leg_counting", {}, 1.0),
    ]
    (sft,) = load_dataset(DatasetConfig(path="reasoning_gym:chain_sum", size=1, type="sft"), seed=1)
    assert sft["messages"][-1] == {
        "role": "assistant",
        "content": f"<answer>{sft['reference']['answer']}</answer>",
    }


def test_reasoning_gym_episode_scores_the_tagged_answer_with_the_tasks_scorer(scripted):
    (item,) = load_dataset(DatasetConfig(path="reasoning_gym:chain_sum", size=1), seed=0)
    answer = item["reference"]["answer"]
    wf = make_env_workflow(WorkflowConfig(type="reasoning_gym"), G, scripted([]).tokenizer)
    right = _run(wf, scripted([f"<answer>{answer}</answer>"], version=3), item)
    wrong = _run(wf, scripted(["<answer>nope</answer>"]), item)
    assert (right[0].reward, wrong[0].reward) == (1.0, 0.0)
    assert right[0].reference == answer  # shown by areal view beside the reply
    assert set(right[0].versions) == {3} and right[0].logprobs[0] == -0.5


def test_openenv_episode_plays_until_done_and_sums_the_step_rewards(scripted):
    cfg = WorkflowConfig(type="openenv", env="openenv_guess:GuessEnv", max_turns=3)
    wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
    item = {"id": "e0", "seed": 0, "messages": [{"role": "system", "content": "Play."}]}
    # seed 0's digit is 6: a wrong guess (told "higher"), then the right one
    engine = scripted(["3", "6"], version=2)
    (traj,) = _run(wf, engine, item)
    assert traj.reward == 1.0
    assert len(traj.turn_starts) == 2 and "higher" in engine.tokenizer.decode(traj.completion_ids)
    # the two model turns: trained (versions 2 and 3), the hint between them injected (-1, mask 0)
    assert {v for v in traj.versions if v >= 0} == {2, 3}
    hint = [m for m, v in zip(traj.loss_mask, traj.versions) if v == -1]
    assert hint and not any(hint)
    assert wf.stats()["agent/episodes_failed"] == 0


@pytest.mark.parametrize(
    ("env", "counter"),
    [
        ("RaisingEnv", "agent/env_errors"),
        ("HangingEnv", "agent/env_timeouts"),
        ("NaNEnv", "agent/env_bad_rewards"),
        ("SilentEnv", "agent/env_bad_rewards"),
    ],
)
def test_a_faulty_environment_fails_its_episode_only(scripted, env, counter):
    cfg = WorkflowConfig(type="openenv", env=f"openenv_faults:{env}", env_timeout=0.2)
    wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
    item = {"id": "e0", "seed": 0, "messages": []}
    assert _run(wf, scripted(["5"]), item) is None  # the group is dropped, nothing raised
    stats = wf.stats()
    assert stats[counter] == 1 and stats["agent/episodes_failed"] == 1
    good = make_env_workflow(
        WorkflowConfig(type="openenv", env="openenv_guess:GuessEnv"),
        G,
        scripted([]).tokenizer,
    )
    assert _run(good, scripted(["6"]), item)[0].reward == 1.0  # seed 0: digit 6


def test_a_scorer_returning_nan_fails_the_episode(scripted, monkeypatch):
    from areal.workflow.envs import reasoning_gym as rg

    monkeypatch.setattr(rg, "score", lambda task, answer, entry: math.nan)
    (item,) = load_dataset(DatasetConfig(path="reasoning_gym:chain_sum", size=1), seed=0)
    wf = make_env_workflow(WorkflowConfig(type="reasoning_gym"), G, scripted([]).tokenizer)
    assert _run(wf, scripted(["1"]), item) is None
    assert wf.stats()["agent/env_bad_rewards"] == 1


def test_missing_extra_is_refused_in_one_line_naming_it(monkeypatch):
    from areal.api.config import GRPOConfig
    from areal.dataset import envs
    from areal.runtime.preflight import _workflow_problems

    monkeypatch.setitem(envs.PACKAGES, "openenv", "openenv_not_installed_here")
    cfg = GRPOConfig(workflow=WorkflowConfig(type="openenv", env="a:B"))
    (problem,) = _workflow_problems(cfg)
    assert "\n" not in problem and "pip install -e '.[envs]'" in problem
    with pytest.raises(ImportError, match=r"pip install -e '\.\[envs\]'"):
        make_env_workflow(cfg.workflow, G, None)


def test_preflight_names_an_environment_that_does_not_import():
    from areal.api.config import GRPOConfig
    from areal.runtime.preflight import _workflow_problems

    cfg = GRPOConfig(
        workflow=WorkflowConfig(type="verifiers", env="no_such_module:tasks"),
        train_dataset=DatasetConfig(path="verifiers:no_such_module:tasks"),
    )
    (problem,) = _workflow_problems(cfg)
    assert problem.startswith("workflow.env: cannot import 'no_such_module'")
    ok = GRPOConfig(workflow=WorkflowConfig(type="openenv", env="openenv_guess:GuessEnv"))
    assert _workflow_problems(ok) == [
        "train_dataset.path: 'arithmetic' does not hold workflow.type=openenv items; use "
        "openenv... (docs/environments.md)"
    ]
    ok = dataclasses.replace(ok, train_dataset=DatasetConfig(path="openenv"))
    assert _workflow_problems(ok) == []


def test_openenv_by_address_plays_over_the_servers_websocket(scripted):
    import uvicorn
    from openenv.core.env_server import create_app
    from openenv_guess import GuessAction, GuessEnv, GuessObservation

    from areal.utils.network import free_port

    port = free_port()
    app = create_app(GuessEnv, GuessAction, GuessObservation)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.05)
        cfg = WorkflowConfig(type="openenv", env=f"http://127.0.0.1:{port}", max_turns=3)
        wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
        item = {"id": "e0", "seed": 0, "messages": []}
        (traj,) = _run(wf, scripted(["3", "6"]), item)
        assert traj.reward == 1.0
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _vf_item(spec: str) -> dict:
    (item,) = load_dataset(DatasetConfig(path=f"verifiers:{spec}", size=1), seed=0)
    return item


def test_verifiers_single_turn_task_is_scored_by_its_reward(scripted):
    item = _vf_item("verifiers_tasks:sum_taskset")
    answer = item["reference"]["answer"]
    cfg = WorkflowConfig(type="verifiers", env="verifiers_tasks:sum_taskset")
    wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
    assert _run(wf, scripted([f"It is {answer}."], version=4), item)[0].reward == 1.0
    (wrong,) = _run(wf, scripted(["It is 100."]), item)
    assert wrong.reward == 0.0 and set(wrong.versions) == {0}


def test_verifiers_tool_calls_run_the_toolsets_method_and_feed_its_result_back(scripted):
    item = _vf_item("verifiers_tasks:calc_taskset")
    a, b = item["messages"][-1]["content"].split("?")[0].split()[-3::2]  # "What is A * B? ..."
    answer = item["reference"]["answer"]
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": %s, "b": %s}}\n</tool_call>'
    cfg = WorkflowConfig(type="verifiers", env="verifiers_tasks:calc_taskset", max_turns=3)
    wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
    engine = scripted([call % (a, b), f"So {answer}."], version=1)
    (traj,) = _run(wf, engine, item)
    text = engine.tokenizer.decode(traj.completion_ids)
    assert traj.reward == 1.0 and f"\n{answer}<|im_end|>" in text  # the tool's result, injected
    assert len(traj.turn_starts) == 2 and {v for v in traj.versions if v >= 0} == {1, 2}
    # a call to a tool that does not exist is the model's mistake: answered, not a failure
    engine = scripted(['<tool_call>\n{"name": "divide", "arguments": {}}\n</tool_call>', "no"])
    (traj,) = _run(wf, engine, item)
    assert traj.reward == 0.0 and "no tool 'divide'" in engine.tokenizer.decode(traj.completion_ids)
    assert wf.stats()["agent/episodes_failed"] == 0


@pytest.mark.parametrize(
    ("spec", "counter"),
    [
        ("verifiers_faults:raising", "agent/env_errors"),
        ("verifiers_faults:hanging", "agent/env_timeouts"),
        ("verifiers_faults:nan", "agent/env_bad_rewards"),
    ],
)
def test_a_faulty_verifiers_rubric_fails_its_episode_only(scripted, spec, counter):
    item = _vf_item(spec)
    cfg = WorkflowConfig(type="verifiers", env=spec, env_timeout=0.2)
    wf = make_env_workflow(cfg, G, scripted([]).tokenizer)
    assert _run(wf, scripted(["5"]), item) is None
    assert wf.stats()[counter] == 1 and wf.stats()["agent/episodes_failed"] == 1
