"""Tier 1: DPOConfig's cross-field rules report every problem at once, with the field and fix."""

from __future__ import annotations

import pytest
from test_configs import EXAMPLES

from areal.api.config import ConfigError, DPOConfig, load_config

YAML = ["--config", str(EXAMPLES / "dpo_arithmetic.yaml")]


def test_demo_config_is_sigmoid_dpo_on_pairs_with_a_precomputed_reference():
    cfg = load_config(DPOConfig, YAML)
    assert (cfg.dpo.loss_type, cfg.dpo.ref_logp, cfg.ref) == ("sigmoid", "precompute", None)
    assert (
        cfg.train_dataset.type == cfg.valid_dataset.type == "rw"
        and cfg.model.mb_spec.granularity == 2
    )


def test_knobs_that_would_have_no_effect_or_split_pairs_are_errors():
    with pytest.raises(ConfigError) as e:
        load_config(
            DPOConfig,
            [
                *YAML,
                "dpo.loss_type=ipo",
                "dpo.label_smoothing=0.1",
                "dpo.gamma=1",
                "model.mb_spec.granularity=3",
                "train_dataset.type=sft",
                "cluster.n_servers=1",
            ],
        )
    msg = str(e.value)
    for expected in [
        "dpo.label_smoothing: 0.1 is not defined for ipo",
        "dpo.gamma: 1.0 is SimPO's margin and has no effect with loss_type=ipo",
        "model.mb_spec.granularity: must be even so pairs stay together, got 3",
        "train_dataset.type: DPO needs preference pairs ('rw'), got 'sft'",
        "cluster.n_servers: DPO uses no generation servers, got 1",
    ]:
        assert expected in msg, msg
    with pytest.raises(ConfigError) as e:
        load_config(
            DPOConfig,
            [
                *YAML,
                "dpo.loss_type=simpo",
                "dpo.ref_logp=online",
                "ref.path=x",
                "ref.mb_spec.granularity=2",
            ],
        )
    assert "dpo.ref_logp: online has no effect with loss_type=simpo" in str(e.value)
    assert "ref: simpo is reference-free and would not use it; set ref=null" in str(e.value)
    simpo = load_config(DPOConfig, [*YAML, "dpo.loss_type=simpo", "dpo.beta=2.0", "dpo.gamma=0.5"])
    assert simpo.dpo.gamma == 0.5
