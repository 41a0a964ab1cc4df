"""docs/config.md: which config trees the reference documents, and the command that writes it.

``areal config-docs`` (or ``python -m areal.config_docs``) renders every training experiment,
Lite's and Core's, grouped by the sections they share, then the tools' own configs, with the
renderer of :mod:`areal.api.config.docs`. It lives at the top layer because Core's configs
(``areal.core``) and the tools' (``areal.dataset``) sit above ``areal.api``.
``tests/test_config_reference.py`` fails when the committed file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal.api.config.docs import EXPERIMENTS, render_config_docs, write_config_docs
from areal.api.config.tinker import TinkerConfig
from areal.core.config import CoreAsyncGRPOConfig, CoreGRPOConfig
from areal.core.graphs import CoreGraphConfig
from areal.core.sft import CoreSFTConfig
from areal.dataset.arithmetic_pairs import ArithmeticPairsConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"

# (config class, entry point), in the order the reference documents them.
ALL_EXPERIMENTS: list[tuple[type, str]] = [
    *EXPERIMENTS,
    (CoreGRPOConfig, "areal core sync-ppo (areal/core/sync_ppo.py)"),
    (CoreAsyncGRPOConfig, "areal core async-ppo (areal/core/async_ppo.py)"),
    (CoreSFTConfig, "areal core sft (areal/core/sft.py)"),
]
TOOLS: list[tuple[type, str]] = [
    (CoreGraphConfig, "areal core graph"),
    (ArithmeticPairsConfig, "areal dpo-pairs"),
    (TinkerConfig, "areal tinker serve"),
]


def render() -> str:
    """The text of docs/config.md."""
    return render_config_docs(ALL_EXPERIMENTS, TOOLS)


def write(out: str | Path = DOCS) -> Path:
    """Write the reference to ``out`` (default docs/config.md); the path written."""
    return write_config_docs(out, ALL_EXPERIMENTS, TOOLS)


def main(argv: list[str] | None = None) -> int:
    """``python -m areal.config_docs [OUT]``: write the reference (``-``: to stdout)."""
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else str(DOCS)
    if out == "-":
        sys.stdout.write(render())
    else:
        print(f"wrote {write(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
