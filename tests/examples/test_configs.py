"""Every YAML in examples/ loads with its entry script's CONFIG class (tier 1: no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal.api.config import GRPOConfig, load_config
from areal.launcher.common import load_script_config_class

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))

# A YAML names its script by a word in its file name: *_grpo / *_ppo -> gsm8k_grpo.py (every RL
# algorithm), sft* -> sft.py, rm* -> rm.py, *dpo* -> dpo.py.
SCRIPT_BY_WORD = {
    "grpo": "gsm8k_grpo.py",
    "ppo": "gsm8k_grpo.py",
    "sft": "sft.py",
    "rm": "rm.py",
    "dpo": "dpo.py",
}


# workflow.type=agent / agent_cmd, and on-policy distillation: the RL script
SCRIPT_BY_NAME = {
    "agent_arithmetic.yaml": "gsm8k_grpo.py",
    "agent_arithmetic_sdk.yaml": "gsm8k_grpo.py",
    "agent_arithmetic_langgraph.yaml": "gsm8k_grpo.py",
    "arithmetic_distill.yaml": "gsm8k_grpo.py",
}


def script_for(yaml_path: Path) -> Path:
    """The entry script a YAML in examples/ is written for."""
    if yaml_path.name in SCRIPT_BY_NAME:
        return EXAMPLES / SCRIPT_BY_NAME[yaml_path.name]
    scripts = {SCRIPT_BY_WORD[w] for w in yaml_path.stem.split("_") if w in SCRIPT_BY_WORD}
    assert len(scripts) == 1, (
        f"{yaml_path.name}: cannot tell its entry script from the name "
        f"(words {sorted(SCRIPT_BY_WORD)}); rename it or extend SCRIPT_BY_WORD in this test"
    )
    return EXAMPLES / scripts.pop()


def test_examples_hold_the_expected_configs():
    names = {p.name for p in YAMLS}
    assert {
        "gsm8k_grpo.yaml",
        "arithmetic_grpo.yaml",
        "sft_arithmetic.yaml",
        "rm.yaml",
        "dpo_arithmetic.yaml",
    } <= names


@pytest.mark.parametrize("yaml_path", YAMLS, ids=lambda p: p.name)
def test_example_yaml_loads_with_its_script_config_class(yaml_path):
    config_cls = load_script_config_class(script_for(yaml_path))
    cfg = load_config(config_cls, ["--config", str(yaml_path)])
    assert isinstance(cfg, config_cls)


def test_gsm8k_recipe_is_the_async_gpu_layout_it_documents():
    cfg = load_config(GRPOConfig, ["--config", str(EXAMPLES / "gsm8k_grpo.yaml")])
    assert cfg.actor.algorithm == "grpo" and not cfg.actor.use_critic
    assert cfg.gconfig.n_samples == 8
    assert cfg.rollout.max_staleness > 0 and cfg.actor.use_decoupled_loss
    assert cfg.eval_gconfig.greedy and cfg.eval_gconfig.max_new_tokens == cfg.gconfig.max_new_tokens
    # the launcher pins the one server to the GPU after the trainer ranks; inside it is `cuda`
    assert cfg.server.device == "cuda"
    assert cfg.cluster.n_servers == 1 and cfg.cluster.trainer_nprocs + 1 == 8
    assert cfg.train_dataset.batch_size % cfg.cluster.trainer_nprocs == 0
    assert cfg.train_dataset.format == cfg.valid_dataset.format == "gsm8k"


@pytest.mark.parametrize("kind", ["rlvr", "multi_turn"])
def test_grpo_script_trains_the_workflow_the_config_names(kind, tiny_tokenizer, tmp_path):
    from areal.runtime.rl import make_workflow
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.rlvr import RLVRWorkflow

    overrides = [f"workflow.type={kind}", "gconfig.n_samples=3", "gconfig.temperature=0.7"]
    if kind == "multi_turn":
        overrides.append("workflow.max_turns=3")
    cfg = load_config(GRPOConfig, ["--config", str(EXAMPLES / "arithmetic_grpo.yaml"), *overrides])
    workflow = make_workflow(cfg, reward=None, tokenizer=tiny_tokenizer, dump_dir=tmp_path)
    assert type(workflow) is {"rlvr": RLVRWorkflow, "multi_turn": MultiTurnWorkflow}[kind]
    assert workflow.n_samples == 3 and workflow.gconfig.temperature == 0.7
    if kind == "multi_turn":
        assert workflow.cfg.max_turns == 3


def test_multi_turn_knobs_without_the_multi_turn_workflow_are_an_error():
    from areal.api.config import ConfigError

    with pytest.raises(ConfigError, match="max_turns: 3 has no effect with type=rlvr"):
        load_config(
            GRPOConfig, ["--config", str(EXAMPLES / "arithmetic_grpo.yaml"), "workflow.max_turns=3"]
        )
