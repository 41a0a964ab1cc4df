"""The config reference renderer: every field path and help, shared sections once, rows in YAML
terms (tier 1). The committed docs/config.md itself: tests/test_config_reference.py."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from areal.api.config import DPOConfig, GRPOConfig, RWConfig, SFTConfig, iter_fields, param
from areal.api.config.docs import render_config_docs


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


def test_tools_are_documented_each_on_their_own_after_the_experiments():
    text = render_config_docs([(_Outer, "examples/outer.py")], tools=[(_Inner, "areal inner")])
    tool = text.index("## `_Inner` (`areal inner`)")
    assert text.index("## Experiments") < tool
    assert "| `mode` | one of `a`, `b` |" in text[tool:]  # its fields at its own top level
