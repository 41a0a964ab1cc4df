"""The config loader reads YAML 1.2 (yes/on are strings, 1e-5 is a float), rejects NaN / inf in
float fields unless a field opts in, and reports field and cross-field problems together."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from areal.api.config import (
    BaseExperimentConfig,
    ConfigError,
    GenerationHyperparameters,
    GenerationServerConfig,
    GRPOConfig,
    InferenceEngineConfig,
    PPOActorConfig,
    SFTConfig,
    TrainEngineConfig,
    from_dict,
    load_config,
    param,
    parse_overrides,
    read_yaml,
    save_config,
)
from areal.api.config.loader import Yaml12Loader

SFT = ["train_dataset.type=sft"]  # SFTConfig's own rule needs it; without it every load fails


def _problems(cls, argv: list[str], yaml_text: str | None = None, tmp_path=None) -> list[str]:
    if yaml_text is not None:
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml_text)
        argv = ["--config", str(path), *argv]
    with pytest.raises(ConfigError) as e:
        load_config(cls, argv)
    return e.value.problems


@dataclass(frozen=True)
class Knobs:
    """Float shapes the finiteness check must reach: plain, optional, union, list, opted in."""

    scale: float = param(1.0, gt=0, help="Scale; write a positive finite number.")
    cap: float | None = param(None, help="Cap, or null for none.")
    step: int | float = param(1, help="Step size.")
    weights: list[float] = param([1.0, 2.0], help="Per-source weights.")
    clip: float = param(math.inf, allow_nonfinite=True, gt=0, help="Clip; .inf disables it.")


@dataclass(frozen=True)
class Window:
    """A cross-field rule that compares two ints (and so raises on a non-int)."""

    lo: int = param(0, help="Lower end.")
    hi: int = param(1, help="Upper end.")

    def check(self) -> Iterator[str]:
        if self.lo > self.hi:
            yield f"lo: {self.lo} > hi {self.hi}; swap them"


# ----------------------------------------------------------------------------- YAML 1.2 scalars


@pytest.mark.parametrize(
    "text, expected",
    [
        ("yes", "yes"),
        ("no", "no"),
        ("on", "on"),
        ("off", "off"),
        ("y", "y"),
        ("n", "n"),
        ("true", True),
        ("True", True),
        ("FALSE", False),
        ("1e30", 1e30),
        ("1e-5", 1e-5),
        (".5", 0.5),
        ("-1.5E+3", -1500.0),
        ("1.", 1.0),
        ("012", 12),  # YAML 1.1 read this as octal 10
        ("0o17", 15),
        ("0x1F", 31),
        ("+5", 5),
        ("~", None),
        ("null", None),
        ("NULL", None),
        ("", None),
        ("2024-01-01", "2024-01-01"),  # YAML 1.1 read this as a datetime.date
        ("1_000", "1_000"),  # not a YAML 1.2 int
    ],
)
def test_plain_scalars_resolve_by_the_yaml_1_2_core_schema(text, expected):
    value = yaml.load(f"a: {text}", Loader=Yaml12Loader)["a"]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text, sign", [(".inf", 1), ("-.inf", -1), (".Inf", 1), ("+.INF", 1)])
def test_infinity_spellings_load_as_float_infinity(text, sign):
    assert yaml.load(f"a: {text}", Loader=Yaml12Loader)["a"] == sign * math.inf


@pytest.mark.parametrize("text", [".nan", ".NaN", ".NAN"])
def test_nan_spellings_load_as_float_nan(text):
    assert math.isnan(yaml.load(f"a: {text}", Loader=Yaml12Loader)["a"])


def test_yaml_safeloader_itself_still_reads_yaml_1_1():
    assert yaml.safe_load("a: yes\nb: 1e-5") == {"a": True, "b": "1e-5"}


def test_merge_keys_still_share_a_block():
    text = "base: &b {lr: 0.1}\nactor:\n  <<: *b\n  wd: 0.0\n"
    assert yaml.load(text, Loader=Yaml12Loader)["actor"] == {"lr": 0.1, "wd": 0.0}


def test_explicit_tag_on_a_non_number_is_a_yaml_error_with_the_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("seed: 1\nlr: !!float abc\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line 2.*'abc' is not a number"):
        read_yaml(path)


def test_exponent_without_dot_is_a_float_in_a_file_and_in_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("a: 1e30\nb: 1e-5\n")
    tree, problems = parse_overrides(["a=1e30", "b=1e-5"])
    assert problems == []
    for data in (read_yaml(path), tree):
        assert data == {"a": 1e30, "b": 1e-5}
        assert all(type(v) is float for v in data.values())


# ----------------------------------------------------------------------------- bool and str fields


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "n"])
def test_yaml_1_1_boolean_word_for_a_bool_field_names_path_value_and_fix(tmp_path, word):
    expected = f"model.fused_logprobs: expected true/false, got {word!r}; write true or false"
    from_override = _problems(SFTConfig, [*SFT, f"model.fused_logprobs={word}"])
    from_file = _problems(SFTConfig, SFT, f"model:\n  fused_logprobs: {word}\n", tmp_path)
    for problems in (from_override, from_file):
        assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize(("old", "new"), [("true", "full"), ("false", "none")])
def test_gradient_checkpointing_is_refused_with_its_activation_checkpointing_spelling(old, new):
    problems = _problems(SFTConfig, [*SFT, f"model.gradient_checkpointing={old}"])
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        f"model.gradient_checkpointing: {old} is a renamed key; write "
        f"model.activation_checkpointing={new}"
    ), problems


def test_str_field_given_on_keeps_the_word(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("trial_name: off\n")
    cfg = load_config(SFTConfig, ["--config", str(path), *SFT, "experiment_name=on"])
    assert (cfg.experiment_name, cfg.trial_name) == ("on", "off")


# ----------------------------------------------------------------------------- non-finite floats


@pytest.mark.parametrize(
    "raw, shown",
    [
        (".nan", "nan"),
        (".inf", "inf"),
        ("-.inf", "-inf"),
        ('"nan"', "'nan'"),
        ('"-inf"', "'-inf'"),
        ("1e400", "inf"),  # 1e400 overflows to inf when read
        ("1" + "0" * 400, "an integer of 401 digits (too large for a float)"),
    ],
)
def test_non_finite_float_is_rejected_with_path_value_and_help(tmp_path, raw, shown):
    expected = f"model.optimizer.lr: must be a finite number, got {shown}; Peak learning rate."
    from_override = _problems(SFTConfig, [*SFT, f"model.optimizer.lr={raw}"])
    from_file = _problems(SFTConfig, SFT, f"model:\n  optimizer:\n    lr: {raw}\n", tmp_path)
    for problems in (from_override, from_file):
        assert problems == [expected]  # one problem: lr's gt=0 bound is not reported as well


def test_grpo_actor_learning_rate_nan_is_rejected():
    argv = ["actor.path=m", "cluster.n_servers=1", "actor.optimizer.lr=.nan"]
    problems = _problems(GRPOConfig, argv)
    assert any(
        p.startswith("actor.optimizer.lr: must be a finite number, got nan") for p in problems
    ), problems


def test_non_finite_is_found_in_optional_union_and_list_floats():
    data = {"cap": ".nan", "step": math.inf, "weights": [1.0, "-inf", 3.0], "scale": -math.inf}
    with pytest.raises(ConfigError) as e:
        from_dict(Knobs, data)
    paths = [p.split(":")[0] for p in e.value.problems]
    assert paths == ["scale", "cap", "step", "weights[1]"], e.value.problems


def test_huge_int_is_fine_for_an_int_or_float_field():
    assert from_dict(Knobs, {"step": 10**400}).step == 10**400  # the int option takes it


def test_field_with_allow_nonfinite_accepts_infinity_and_keeps_its_bounds():
    assert from_dict(Knobs, {"clip": float("inf")}).clip == math.inf
    assert from_dict(Knobs, {"clip": "inf"}).clip == math.inf
    with pytest.raises(ConfigError, match=r"clip must be > 0, got -inf"):
        from_dict(Knobs, {"clip": -math.inf})
    assert dataclasses.fields(Knobs)[-1].metadata["allow_nonfinite"] is True


def test_finite_floats_still_load():
    cfg = from_dict(Knobs, {"scale": "1e-5", "cap": 1e30, "step": 2.5, "weights": [0, 1e-3]})
    assert (cfg.scale, cfg.cap, cfg.step, cfg.weights) == (1e-5, 1e30, 2.5, [0.0, 1e-3])


# ----------------------------------------------------------------------------- all problems at once


def test_field_error_and_cross_field_error_are_reported_together():
    problems = _problems(SFTConfig, ["seed=-3"])  # train_dataset.type left at 'rl'
    assert len(problems) == 2, problems
    assert problems[0].startswith("seed must be >= 0, got -3")
    assert problems[1].startswith("train_dataset.type: SFT needs 'sft' data, got 'rl'")


def test_cross_field_error_is_reported_beside_an_error_in_another_field_of_its_section():
    with pytest.raises(ConfigError) as e:
        from_dict(
            GenerationHyperparameters,
            {"min_new_tokens": 9, "max_new_tokens": 4, "temperature": ".nan"},
        )
    assert [p.split(":")[0] for p in e.value.problems] == ["temperature", "min_new_tokens"]


def test_cross_field_rule_that_cannot_compare_a_bad_value_is_skipped_not_raised():
    # 'abc' > 1 raises TypeError inside Window.check(); lo's own problem is the report.
    with pytest.raises(ConfigError) as e:
        from_dict(Window, {"lo": "abc"})
    assert e.value.problems == ["lo: expected an integer, got 'abc'"]


def test_cross_field_rule_crashing_on_a_valid_config_propagates():
    @dataclass(frozen=True)
    class Broken:
        n: int = param(1, help="n.")

        def check(self) -> Iterator[str]:
            raise TypeError("bug in check")
            yield  # pragma: no cover

    with pytest.raises(TypeError, match="bug in check"):
        from_dict(Broken, {"n": 2})


def test_int_field_still_accepts_a_whole_float():
    assert load_config(SFTConfig, [*SFT, "seed=2.0", "total_train_epochs=1e1"]).seed == 2


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "cls",
    [
        BaseExperimentConfig,
        PPOActorConfig,
        TrainEngineConfig,
        InferenceEngineConfig,
        GenerationServerConfig,
    ],
)
def test_saved_default_config_loads_back_equal(tmp_path, cls):
    path = save_config(cls(), tmp_path / "config.yaml")
    assert load_config(cls, ["--config", str(path)]) == cls()


def test_saved_config_with_ambiguous_strings_reads_back_the_same_in_yaml_1_1_and_1_2(tmp_path):
    cfg = load_config(
        SFTConfig, [*SFT, "experiment_name=on", "trial_name='1e5'", "model.optimizer.lr=1e-5"]
    )
    path = save_config(cfg, tmp_path / "config.yaml")
    assert load_config(SFTConfig, ["--config", str(path)]) == cfg
    plain = yaml.safe_load(path.read_text())  # what other tools reading the run dir see
    assert (plain["experiment_name"], plain["trial_name"]) == ("on", "1e5")
    assert plain["model"]["optimizer"]["lr"] == 1e-5


def test_saved_config_with_a_list_of_sections_loads_back_equal(tmp_path):
    from areal.core.graphs import CoreGraphConfig

    cfg = load_config(
        CoreGraphConfig,
        [
            "n_workers=2",
            "prox_logp=true",
            "allocations=[{model: actor, workers: [0, 1], tp: 2}]",
            "layouts=[{mfc: actor_logp, dp: 2}]",
        ],
    )
    path = save_config(cfg, tmp_path / "config.yaml")
    assert load_config(CoreGraphConfig, ["--config", str(path)]) == cfg
