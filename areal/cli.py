"""The ``areal`` command: one subcommand per user-facing job; each wires library calls only."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def _tiny_model(args: argparse.Namespace) -> int:
    from areal.utils.tiny_model import build_tiny_model, count_parameters

    out = build_tiny_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote {args.size} model ({count_parameters(out):,} parameters) to {out}")
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from areal.quickstart import run_quickstart

    return run_quickstart(args.out)


def _plot(args: argparse.Namespace) -> int:
    from areal.utils.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal", description="Asynchronous RL for LLM post-training on verifiable tasks."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("tiny-model", help="write a tiny random Qwen2-style HF model directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="tiny ~3M, small ~25M")
    p.add_argument("--seed", type=int, default=0, help="init seed")
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("quickstart", help="the embedded demo on this machine (CPU, no network)")
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.set_defaults(func=_quickstart)
    p = sub.add_parser("plot", help="plot reward, held-out accuracy and stage times of a run")
    p.add_argument("run_dir", help="RUN_DIR holding stats.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plot.png)")
    p.set_defaults(func=_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
