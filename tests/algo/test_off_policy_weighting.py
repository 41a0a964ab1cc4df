"""Tier 1: the one off-policy weighting (``actor.rollout_correction``) and its migration. Each old
key (behaviour cap, truncated IS, the always-on proximal pass, the correction's form) is refused
in one line naming its value and the new spelling, and that spelling, loaded as written, gives
the loss weights the old keys gave (hand-worked numbers, the same as the old keys' tests)."""

import math
import re
import typing
from pathlib import Path

import pytest
import torch

from areal.algo.correction import rollout_weights
from areal.algo.losses import policy_loss
from areal.api.config import GRPOConfig, load_config
from areal.api.config.actor import (
    CORRECTION_PRESETS,
    CorrectionPreset,
    PPOActorConfig,
    RolloutCorrectionConfig,
)
from areal.api.config.loader import ConfigError

BASE = ["actor.use_critic=false", "cluster.n_servers=1"]


def _refusal(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, [*BASE, *argv])
    return e.value.problems


def _new_spelling(problem: str) -> list[str]:
    """The ``key=value`` assignments a refusal says to write."""
    match = re.search(r"; write (.*?) \(docs/config.md", problem)
    assert match, problem
    return match.group(1).split()


@pytest.mark.parametrize(
    ("old", "line"),
    [
        (
            ["actor.use_decoupled_loss=true", "actor.behav_imp_weight_cap=5.0"],
            "actor.behav_imp_weight_cap: 5.0 is a renamed key; write "
            "actor.rollout_correction.mode=mask actor.rollout_correction.upper=5.0",
        ),
        (
            ["actor.behav_imp_weight_cap=3", "actor.behav_imp_weight_mode=clamp"],
            "actor.behav_imp_weight_mode: clamp is a renamed key; write "
            "actor.rollout_correction.mode=truncate",
        ),
        (
            ["actor.use_decoupled_loss=true", "actor.behav_imp_weight_level=sequence"],
            "actor.behav_imp_weight_level: sequence is a renamed key; write "
            "actor.rollout_correction.level=geometric",
        ),
        (
            ["actor.tis_cap=2.0"],
            "actor.tis_cap: 2.0 is a renamed key; write actor.use_decoupled_loss=true "
            "actor.rollout_correction.mode=truncate actor.rollout_correction.upper=2.0",
        ),
        (
            ["actor.tis_cap=null"],
            "actor.tis_cap: null is a renamed key; delete it, the defaults do what it did",
        ),
        (
            ["actor.use_decoupled_loss=true", "actor.recompute_prox_logp=true"],
            "actor.recompute_prox_logp: true is a renamed key; write "
            "actor.prox_logp=recompute_always",
        ),
        (
            ["actor.rollout_correction.mode=truncate", "actor.rollout_correction.form=bypass"],
            "actor.rollout_correction.form: bypass is a renamed key; write "
            "actor.use_decoupled_loss=false",
        ),
    ],
)
def test_each_old_key_is_refused_in_one_line_naming_its_value_and_the_new_spelling(old, line):
    key = old[-1].split("=")[0]
    problems = _refusal(old)
    mine = [p for p in problems if p.startswith(key + ":")]
    assert len(mine) == 1, problems
    assert mine[0].startswith(line), mine[0]
    assert mine[0].endswith('(docs/config.md, "Renamed keys")')


def test_an_old_key_in_a_yaml_file_is_refused_the_same_way(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("actor:\n  use_decoupled_loss: true\n  behav_imp_weight_cap: 5.0\n")
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, ["--config", str(path), *BASE])
    (line,) = e.value.problems
    assert line == (
        "actor.behav_imp_weight_cap: 5.0 is a renamed key; write actor.rollout_correction.mode="
        'mask actor.rollout_correction.upper=5.0 (docs/config.md, "Renamed keys")'
    )


def _loss(cfg: PPOActorConfig, ratio: list[float], weight: list[float], seqs=(0, 2)):
    """policy_loss on one token per entry, A = 1, logp = prox + log(ratio), behav = prox -
    log(weight) (so pi_prox / pi_behav = weight)."""
    prox = torch.full((len(ratio),), -1.0)
    logp = (prox + torch.log(torch.tensor(ratio))).requires_grad_()
    behav = prox - torch.log(torch.tensor(weight))
    n = len(ratio)
    return policy_loss(
        logp, prox, behav, torch.ones(n), torch.ones(n), torch.tensor(seqs), cfg.actor
    )


def _migrated(old: list[str]) -> GRPOConfig:
    """``old`` with each refused key replaced by the spelling its refusal names, loaded."""
    problems = _refusal(old)
    refused = {p.split(":")[0] for p in problems}
    kept = [a for a in old if a.split("=")[0] not in refused]
    new = [a for p in problems for a in _new_spelling(p)]
    return load_config(GRPOConfig, [*BASE, *kept, *dict.fromkeys(new)])


def test_the_behaviour_cap_spelled_anew_masks_the_over_cap_token_as_before():
    cfg = _migrated(["actor.use_decoupled_loss=true", "actor.behav_imp_weight_cap=3.0"])
    assert cfg.actor.rollout_correction == RolloutCorrectionConfig(mode="mask", upper=3.0)
    loss, stats = _loss(cfg, ratio=[1.0, 1.0], weight=[2.0, 4.0])
    # token 0: -A * r * w = -1 * 1 * 2 = -2; token 1: w = 4 > 3 dropped (0) but counted:
    # (-2 + 0) / 2 = -1
    assert loss.item() == pytest.approx(-1.0)
    assert stats["rc_masked_frac"].item() == 0.5 and stats["rc_weight_max"].item() == 2.0


def test_truncated_is_spelled_anew_truncates_the_weight_at_the_cap_as_before():
    cfg = _migrated(["actor.tis_cap=2.0"])
    assert cfg.actor.use_decoupled_loss
    assert cfg.actor.rollout_correction == RolloutCorrectionConfig(mode="truncate", upper=2.0)
    loss, stats = _loss(cfg, ratio=[1.0], weight=[5.0], seqs=(0, 1))
    assert loss.item() == pytest.approx(-2.0)  # -A * r * min(5, 2) = -2
    assert stats["rc_weight_max"].item() == 2.0 and stats["rc_masked_frac"].item() == 0.0


def test_the_combined_clamped_sequence_cap_spelled_anew_clamps_the_geometric_mean():
    old = [
        "actor.use_decoupled_loss=true",
        "actor.behav_imp_weight_cap=3.0",
        "actor.behav_imp_weight_mode=clamp",
        "actor.behav_imp_weight_level=sequence",
    ]
    cfg = _migrated(old)
    rc = cfg.actor.rollout_correction
    assert (rc.mode, rc.level, rc.upper) == ("truncate", "geometric", 3.0)
    loss, stats = _loss(cfg, ratio=[1.1, 1.0], weight=[2.0, 8.0])
    # one sequence: geometric mean sqrt(2 * 8) = 4 > 3, clamped to 3 on both tokens;
    # ratio 1.1 is inside [0.8, 1.2]: (-1.1 * 3 + -1.0 * 3) / 2 = -3.15
    assert loss.item() == pytest.approx(-3.15)
    assert stats["rc_weight_mean"].item() == pytest.approx(3.0)


def test_the_decoupled_loss_without_a_bound_keeps_its_weight_as_is():
    # the old behav_imp_weight_cap=null: w = 2 and 4 unbounded: (-2 - 4) / 2 = -3
    cfg = load_config(GRPOConfig, [*BASE, "actor.use_decoupled_loss=true"])
    loss, stats = _loss(cfg, ratio=[1.0, 1.0], weight=[2.0, 4.0])
    assert loss.item() == pytest.approx(-3.0) and stats["rc_weight_max"].item() == 4.0


def test_token_and_geometric_weights_mask_or_truncate_at_the_cap():
    prox, behav = torch.log(torch.tensor([2.0, 4.0])), torch.zeros(2)  # weights 2 and 4
    mask, cu = torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])
    w, rejected = rollout_weights(
        prox, behav, mask, cu, RolloutCorrectionConfig(mode="mask", upper=3.0)
    )
    assert w.tolist() == [2.0, 0.0] and rejected.tolist() == [False, True]
    w, _ = rollout_weights(
        prox, behav, mask, cu, RolloutCorrectionConfig(mode="truncate", upper=3.0)
    )
    assert w.tolist() == [2.0, 3.0]
    # geometric: sqrt(2 * 4) = 2.83 < 3, both kept with that weight
    geo = RolloutCorrectionConfig(mode="mask", level="geometric", upper=3.0)
    w, rejected = rollout_weights(prox, behav, mask, cu, geo)
    assert torch.allclose(w, torch.full((2,), math.sqrt(8.0))) and not rejected.any()


def test_every_correction_preset_sets_every_knob_and_none_is_the_default():
    knobs = set(CORRECTION_PRESETS["none"])
    assert set(typing.get_args(CorrectionPreset)) == set(CORRECTION_PRESETS)
    for name, preset in CORRECTION_PRESETS.items():
        assert set(preset) == knobs, name
        cfg = RolloutCorrectionConfig(preset=name)
        assert {k: getattr(cfg, k) for k in knobs} == preset
        assert not list(cfg.check()), name
    default = RolloutCorrectionConfig()
    assert {k: getattr(default, k) for k in knobs} == CORRECTION_PRESETS["none"]


def test_a_correction_preset_loads_and_explicit_knobs_win():
    cfg = load_config(
        GRPOConfig,
        [*BASE, "actor.rollout_correction.preset=icepop", "actor.rollout_correction.upper=4"],
    )
    rc = cfg.actor.rollout_correction
    assert (rc.mode, rc.level, rc.lower, rc.upper) == ("mask", "token", 0.5, 4.0)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def correction_table_markdown() -> str:
    """The preset table in docs/algorithms.md, generated from CORRECTION_PRESETS (a preset per
    row, a knob of ``actor.rollout_correction`` per column)."""
    knobs = list(CORRECTION_PRESETS["none"])
    lines = ["| preset | " + " | ".join(f"`{k}`" for k in knobs) + " |"]
    lines.append("| --- |" + " --- |" * len(knobs))
    for name, preset in CORRECTION_PRESETS.items():
        cells = [
            "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
            for v in preset.values()
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_docs_table_matches_the_correction_presets():
    assert correction_table_markdown() in DOCS.read_text(), (
        "docs/algorithms.md is out of date; paste tests/algo/test_off_policy_weighting.py's "
        "correction_table_markdown() output into it"
    )
