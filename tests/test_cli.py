"""Tier 1: the ``areal`` command's help, version and examples (no process is started)."""

from __future__ import annotations

import pytest

from areal import __version__
from areal.cli import COMMANDS, EXAMPLES, build_parser, main


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_version_prints_the_package_version(capsys):
    code, out, _ = _run(capsys, ["--version"])
    assert code == 0 and out.strip() == f"areal {__version__}"


@pytest.mark.parametrize(
    "argv, config_class",
    [
        (["launch", "local", "examples/gsm8k_grpo.py", "--help"], "GRPOConfig"),
        (["launch", "local", "examples/sft.py", "--config", "x.yaml", "-h"], "SFTConfig"),
        (["core", "sync-ppo", "--help"], "CoreGRPOConfig"),
        (["core", "graph", "--help"], "CoreGraphConfig"),
    ],
    ids=["launch", "launch_short_after_config", "core_sync_ppo", "core_graph"],
)
def test_help_after_a_script_or_core_action_prints_its_config_not_errors(
    capsys, argv, config_class
):
    code, out, err = _run(capsys, argv)
    assert code == 0 and err == ""
    assert out.startswith(f"{config_class}: ") and "usage: [--config YAML] [key=value ...]" in out
    assert "docs/config.md" in out and "problem" not in out


def test_help_of_a_config_lists_fields_with_defaults_and_sections_with_summaries(capsys):
    _, out, _ = _run(capsys, ["launch", "local", "examples/gsm8k_grpo.py", "--help"])
    assert "\n  total_train_steps=None  Stop after this many steps" in out
    assert "\n  actor.*  The policy trained by PPO-family algorithms" in out


def test_core_status_help_is_its_usage_not_a_run_dir(capsys):
    code, out, _ = _run(capsys, ["core", "status", "--help"])
    assert code == 0 and out.startswith("usage: areal core status [-h] RUN_DIR")


def test_every_subcommand_help_has_a_description_and_an_example():
    sub = build_parser()._subparsers._group_actions[0].choices  # name -> its parser
    assert set(sub) == {c.name for c in COMMANDS} == set(EXAMPLES)
    for name, parser in sub.items():
        text = parser.format_help()
        assert parser.description and f"example: areal {name}" in " ".join(text.split()), name
