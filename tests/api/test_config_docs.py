"""docs/config.md is generated from the config dataclasses and must match them (tier 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from areal.api.config import DPOConfig, GRPOConfig, RWConfig, SFTConfig, iter_fields, param
from areal.api.config.docs import EXPERIMENTS, render_config_docs, write_config_docs
from areal.cli import main as cli_main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_config_reference_is_up_to_date():
    assert DOCS.is_file(), "docs/config.md is missing; run `areal config-docs --out docs/config.md`"
    assert DOCS.read_text() == render_config_docs(), (
        "docs/config.md is out of date with the config dataclasses; "
        "run `areal config-docs --out docs/config.md` and commit it"
    )


@pytest.mark.parametrize(
    "cls", [GRPOConfig, SFTConfig, RWConfig, DPOConfig], ids=lambda c: c.__name__
)
def test_every_field_path_and_help_appears_in_the_reference(cls):
    text = render_config_docs()
    missing = [path for path, _, _ in iter_fields(cls) if f"`{path}`" not in text]
    assert not missing, f"{cls.__name__} fields missing from the reference: {missing}"
    for path, f, _ in iter_fields(cls):
        help_text = " ".join(f.metadata["help"].split()).replace("|", "\\|")
        assert help_text in text, f"help of {cls.__name__}.{path} missing"


def test_sections_shared_by_experiments_are_documented_once():
    text = render_config_docs()
    # SFT and RM share `model`; every experiment shares `train_dataset`; GRPO alone has `actor`.
    assert text.count("| `model.optimizer.lr` |") == 1
    assert text.count("| `train_dataset.batch_size` |") == 1
    assert text.count("### `actor`\n") == 1
    sft_rm = text.index("## `SFTConfig` and `RWConfig`")
    assert text.index("### `model`\n") > sft_rm
    assert (
        text.index("## Shared by every experiment") < text.index("### `train_dataset`\n") < sft_rm
    )


@dataclasses.dataclass(frozen=True)
class _Inner:
    """Inner knobs."""

    mode: Literal["a", "b"] = param("a", help="Which mode | pipe.")


@dataclasses.dataclass(frozen=True)
class _Outer:
    """Outer config."""

    name: str = param("x", help="A name.")
    limit: int | None = param(None, ge=1, help="A limit.")
    tags: list[str] = param(["t"], help="Tags.")
    inner: _Inner = param(factory=_Inner, help="The inner section.")
    extra: _Inner | None = param(None, help="An optional section.")


def test_rendered_rows_show_path_type_yaml_default_and_escaped_help():
    text = render_config_docs([(_Outer, "examples/outer.py")])
    assert "| `_Outer`: Outer config. | `examples/outer.py` |" in text
    assert '| `name` | str | `"x"` | A name. |' in text
    assert "| `limit` | int or null | `null` | A limit. |" in text
    assert '| `tags` | list of str | `["t"]` | Tags. |' in text
    assert '| `inner.mode` | one of `a`, `b` | `"a"` | Which mode \\| pipe. |' in text
    assert "`_Inner`: The inner section. Inner knobs." in text
    assert "Default `null` (off)" in text.split("### `extra`")[1]
    assert "| `extra.mode` |" in text


def test_cli_writes_the_reference(tmp_path, capsys):
    out = tmp_path / "docs" / "config.md"
    assert cli_main(["config-docs", "--out", str(out)]) == 0
    assert out.read_text() == render_config_docs()
    assert write_config_docs(tmp_path / "again.md").read_text() == out.read_text()
    assert [cls for cls, _ in EXPERIMENTS] == [GRPOConfig, SFTConfig, RWConfig, DPOConfig]
