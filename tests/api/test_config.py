import dataclasses

import pytest
import yaml

from areal.api.config import (
    BaseExperimentConfig,
    ConfigError,
    GRPOConfig,
    SFTConfig,
    iter_fields,
    load_config,
    save_config,
)


def _load(tmp_path, text: str, *overrides: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config(SFTConfig, ["--config", str(path), *overrides])


def test_defaults_load_with_overrides_and_yaml(tmp_path):
    cfg = _load(tmp_path, "train_dataset:\n  type: sft\nseed: 7\n", "model.optimizer.lr=3e-4")
    assert cfg.seed == 7 and cfg.train_dataset.type == "sft"
    assert cfg.model.optimizer.lr == pytest.approx(3e-4)  # YAML 1.2: 3e-4 is a float


def test_malformed_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"malformed YAML at line 2"):
        _load(tmp_path, "seed: 1\nexperiment_name: a: b\n")


def test_every_problem_is_reported_at_once_with_path_value_and_fix(tmp_path):
    text = (
        "seed: -3\ntrain_dataset:\n  batch_szie: 4\n  type: sft\nmodel:\n  optimizer:\n    lr: "
        "abc\n"
    )
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, text, "model.mb_spec.n_mbs=0", "model.optimizer.lr_scheduler_type=cosin")
    problems = e.value.problems
    assert len(problems) == 5, problems
    msg = str(e.value)
    assert "seed must be >= 0, got -3" in msg  # out of range
    assert "did you mean 'train_dataset.batch_size'?" in msg  # unknown key with suggestion
    assert "model.optimizer.lr: expected a number, got 'abc'" in msg  # wrong type
    assert "model.mb_spec.n_mbs must be >= 1, got 0" in msg
    assert "did you mean 'cosine'?" in msg  # bad choice with suggestion


def test_problems_set_on_the_command_line_are_marked_as_such_beside_the_yaml_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "train_dataset:\n  type: sft\n  batch_szie: 4\n", "model.mb_spec.n_mbs=0")
    assert str(e.value).startswith("2 problem(s) in ") and " and the command line:" in str(e.value)
    yaml_typo, cli_typo = sorted(e.value.problems, key=lambda p: p.startswith("model"))
    assert yaml_typo.startswith("train_dataset.batch_szie") and "command line" not in yaml_typo
    assert "got 0" in cli_typo and cli_typo.endswith(" (set on the command line)")


def test_a_typod_algorithm_is_one_problem_not_also_the_default_presets_critic(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, ["actor.algorithm=grpoo", "cluster.n_servers=1"])
    (problem,) = e.value.problems
    assert problem.startswith("actor.algorithm: got 'grpoo'") and "did you mean 'grpo'" in problem


def test_a_minimal_rl_config_is_told_why_it_needs_a_critic_and_servers():
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, [])
    servers, critic = sorted(e.value.problems)  # "cluster..." < "critic..."
    assert "actor.algorithm='ppo' trains a critic" in critic and "actor.algorithm=grpo" in critic
    assert "cluster.n_servers: 0 (the default)" in servers and "cluster.n_servers=1" in servers


def test_cross_field_rule_names_both_fields(tmp_path):
    with pytest.raises(ConfigError, match="train_dataset.type: SFT needs 'sft' data, got 'rl'"):
        _load(tmp_path, "")


def test_override_without_equals_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(SFTConfig, ["train_dataset.type=sft", "seed"])


def test_config_is_frozen_after_load():
    cfg = load_config(SFTConfig, ["train_dataset.type=sft"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


def test_resolved_config_round_trips_through_run_dir(tmp_path):
    cfg = load_config(
        SFTConfig, ["train_dataset.type=sft", f"fileroot={tmp_path}", "valid_dataset.path=x.jsonl"]
    )
    path = save_config(cfg, cfg.run_dir / "config.yaml")
    assert path == tmp_path / "areal" / "trial0" / "config.yaml"
    assert load_config(SFTConfig, ["--config", str(path)]) == cfg
    assert yaml.safe_load(path.read_text())["valid_dataset"]["path"] == "x.jsonl"


@pytest.mark.parametrize("cls", [BaseExperimentConfig, SFTConfig])
def test_every_field_has_help_and_a_default(cls):
    for path, f, _ in iter_fields(cls):
        assert f.metadata.get("help"), f"{path} has no help string"
        assert (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ), path


def test_grpo_cross_section_rules_are_reported_together():
    from areal.api.config import GRPOConfig

    argv = [
        "actor.path=m",
        "cluster.n_servers=1",
        "actor.algorithm=dapo",
        "gconfig.n_samples=1",
        "gconfig.max_new_tokens=6",
    ]  # dapo turns the overlong penalty on (64 tokens)
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, argv)
    msg = str(e.value)
    assert "actor.overlong_tokens: 64 must be in (0, gconfig.max_new_tokens=6)" in msg
    assert "gconfig.n_samples: 1 with group-level normalisation or dynamic sampling" in msg


def test_sampling_values_a_server_refuses_are_refused_at_load():
    from areal.api.config import GRPOConfig

    argv = [
        "actor.path=m",
        "cluster.n_servers=1",
        "actor.algorithm=grpo",
        "gconfig.n_samples=2",
        "gconfig.temperature=1e-45",
        "gconfig.top_k=100000000000000000000",
        "eval_gconfig.temperature=.nan",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, argv)
    msg = str(e.value)
    assert "gconfig.temperature must be >= 0.0001, got 1e-45" in msg
    assert "gconfig.top_k must be <= 2147483647" in msg
    assert "eval_gconfig.temperature: must be a finite number, got nan" in msg


@pytest.mark.parametrize("name", ["", "a/b", "..", "run 1"])
def test_experiment_and_trial_names_must_be_plain_folder_names(name):
    from areal.api.config import SFTConfig

    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, [f"trial_name={name}", "train_dataset.type=sft"])
    assert "trial_name:" in str(e.value) and "folder name" in str(e.value)
    assert (
        load_config(SFTConfig, ["trial_name=run-1.b_2", "train_dataset.type=sft"]).trial_name
        == "run-1.b_2"
    )


def _sections_with_own_defaults(cls: type, prefix: str = ""):
    """(dotted path, default value) of every section field whose default differs from its
    class's defaults, e.g. eval_gconfig (greedy) vs GenerationHyperparameters()."""
    import dataclasses

    for f in dataclasses.fields(cls):
        if f.default_factory is dataclasses.MISSING:
            continue
        value = f.default_factory()
        if not dataclasses.is_dataclass(value):
            continue
        path = f"{prefix}{f.name}"
        if value != type(value)():
            yield path, value
        yield from _sections_with_own_defaults(type(value), path + ".")


REQUIRED = {
    "GRPOConfig": ["actor.use_critic=false", "cluster.n_servers=1"],
    "SFTConfig": [],
    "RWConfig": [],
}


@pytest.mark.parametrize("cls_name", sorted(REQUIRED))
def test_setting_one_field_of_a_section_keeps_the_sections_own_defaults(cls_name):
    import json

    import areal.api.config as config_module

    cls = getattr(config_module, cls_name)
    sections = dict(_sections_with_own_defaults(cls))
    if cls_name == "GRPOConfig":
        assert sections["eval_gconfig"].greedy  # the case this test was written for
    for path, default in sections.items():
        name = next(
            f.name
            for f in dataclasses.fields(default)
            if type(getattr(default, f.name)) in (int, float, bool, str)
        )
        override = f"{path}.{name}={json.dumps(getattr(default, name))}"
        section = load_config(cls, [override, *REQUIRED[cls_name]])
        for part in path.split("."):
            section = getattr(section, part)
        assert section == default, override  # no field fell back to the class's default
