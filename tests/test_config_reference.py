"""docs/config.md is generated from every config tree, Lite's and Core's experiments and the
tools' configs (areal/config_docs.py), and must match them (tier 1)."""

from __future__ import annotations

import pytest

from areal.api.config import iter_fields
from areal.cli import main as cli_main
from areal.config_docs import ALL_EXPERIMENTS, DOCS, TOOLS, main, render


def test_committed_config_reference_is_up_to_date():
    assert DOCS.is_file(), "docs/config.md is missing; run `areal config-docs`"
    assert DOCS.read_text() == render(), (
        "docs/config.md is out of date with the config dataclasses; run `areal config-docs` "
        "(python -m areal.config_docs) and commit it"
    )


@pytest.mark.parametrize(
    "cls", [cls for cls, _ in [*ALL_EXPERIMENTS, *TOOLS]], ids=lambda c: c.__name__
)
def test_every_field_path_and_help_appears_in_the_reference(cls):
    text = render()
    missing = [path for path, _, _ in iter_fields(cls) if f"`{path}`" not in text]
    assert not missing, f"{cls.__name__} fields missing from the reference: {missing}"
    for path, f, _ in iter_fields(cls):
        help_text = " ".join(f.metadata["help"].split()).replace("|", "\\|")
        assert help_text in text, f"help of {cls.__name__}.{path} missing"


def test_core_configs_and_tools_are_in_the_reference():
    text = render()
    names = {cls.__name__ for cls, _ in [*ALL_EXPERIMENTS, *TOOLS]}
    assert {"CoreGRPOConfig", "CoreAsyncGRPOConfig", "CoreSFTConfig", "CoreGraphConfig"} <= names
    assert "## `CoreGraphConfig` (`areal core graph`)" in text
    assert "## `ArithmeticPairsConfig` (`areal dpo-pairs`)" in text


def test_cli_and_module_write_the_same_reference(tmp_path):
    out = tmp_path / "docs" / "config.md"
    assert cli_main(["config-docs", "--out", str(out)]) == 0
    assert out.read_text() == render()
    assert main([str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == out.read_text()
