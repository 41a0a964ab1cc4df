"""The ``areal`` command: one subcommand per user-facing job; each wires library calls only."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable


def _tiny_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from areal.utils.tiny_model import build_tiny_model, count_parameters

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise NotADirectoryError(
            f"--out {args.out}: is a file, not a directory; pass a new or "
            "existing directory, e.g. --out models/tiny"
        )
    out = build_tiny_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote {args.size} model ({count_parameters(out):,} parameters) to {out}")
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from areal.quickstart import run_quickstart

    return run_quickstart(
        args.out, task=args.task, sft_overrides=args.sft, grpo_overrides=args.grpo
    )


def _eval(args: argparse.Namespace) -> int:
    from areal.evaluate import main as eval_main

    argv = (["--config", args.config] if args.config else []) + args.overrides
    return eval_main(args.model, argv, args.out)


def _dpo_pairs(args: argparse.Namespace) -> int:
    from areal.api.config import load_config
    from areal.dataset.arithmetic_pairs import ArithmeticPairsConfig, write_arithmetic_pairs

    argv = (["--config", args.config] if args.config else []) + args.overrides
    argv += [f"{k}={json.dumps(getattr(args, k))}" for k in ("model", "out")]
    print(json.dumps(write_arithmetic_pairs(load_config(ArithmeticPairsConfig, argv)), indent=2))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from areal.utils.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def _view(args: argparse.Namespace) -> int:
    from areal.utils.viewer import serve

    serve(args.run_dirs, args.port)
    return 0


def _replay(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    from areal.runtime.replay import read_meta, replay_run

    script = args.script or read_meta(args.run_dir)["script"]
    if not script or not Path(script).is_file():
        raise FileNotFoundError(
            f"entry script {script!r} of {args.run_dir} is not there; pass --script PATH "
            "(the script that trained it, e.g. examples/gsm8k_grpo.py)"
        )
    spec = importlib.util.spec_from_file_location("areal_replayed_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its CONFIG, setup_trainers and train_step: the run's own code
    try:
        report = replay_run(
            args.run_dir,
            module.CONFIG,
            module.setup_trainers,
            module.train_step,
            to=args.to,
            knobs=tuple(args.knobs),
        )
    except ValueError as e:
        raise SystemExit(f"areal replay: {e}") from None
    print(report.text())
    return 0 if report.ok else 1


def _serve(args: argparse.Namespace) -> int:
    from areal.api.config import ConfigError, load_config
    from areal.api.config.server import GenerationServerConfig
    from areal.api.launch import server_api_key
    from areal.runtime.preflight import model_dir_problem
    from areal.serving.server import main as serve_main

    flags = {"model": "model_path", "host": "host", "port": "port", "api_key": "api_key"}
    argv = ["--config", args.config] if args.config else []
    argv += args.overrides  # the short flags below win over --config and dotted overrides
    argv += [
        f"{k}={json.dumps(getattr(args, f))}"
        for f, k in flags.items()
        if getattr(args, f) is not None
    ]
    if args.api_key is None and server_api_key():  # the key by env: kept off the command line
        argv.append(f"api_key={json.dumps(server_api_key())}")
    cfg = load_config(GenerationServerConfig, argv)
    if not cfg.model_path:
        raise ConfigError(["model_path: empty; pass --model DIR (a Hugging Face model directory)"])
    problem = model_dir_problem("model_path", cfg.model_path)
    if problem:
        raise ConfigError([problem])
    return serve_main(cfg)


def _config_docs(args: argparse.Namespace) -> int:
    from areal.api.config.docs import render_config_docs, write_config_docs

    if args.out == "-":
        sys.stdout.write(render_config_docs())
    else:
        print(f"wrote {write_config_docs(args.out)}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    if args.mode == "local":
        from areal.launcher.local import launch_local

        return launch_local(args.script, args.rest)
    if args.mode == "ray":
        from areal.launcher.ray import launch_ray

        return launch_ray(args.script, args.rest)
    if args.mode == "slurm":
        from areal.launcher.slurm import launch_slurm

        return launch_slurm(args.script, args.rest)
    raise SystemExit(f"areal launch {args.mode}: unknown mode; use local, ray or slurm")


def _core_scale(argv: list[str]) -> int:
    from areal.core.rollout_side import request_scale

    p = argparse.ArgumentParser(
        prog="areal core scale",
        description="Scale a running `areal core async-ppo` "
        "job: the master applies the request at its next step (docs/core.md).",
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--rollout-workers", type=int, default=None, help="the number of rollout workers wanted"
    )
    p.add_argument(
        "--add-server",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a running generation server to use (it gets the current weights first)",
    )
    p.add_argument(
        "--remove-server",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a server to stop routing to (its in-flight requests finish)",
    )
    a = p.parse_args(argv)
    try:
        req = request_scale(a.run_dir, a.rollout_workers, a.add_server, a.remove_server)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"areal core scale: {e}") from None
    print(f"requested {req}; the master applies it at its next step")
    return 0


def _core(args: argparse.Namespace) -> int:
    if args.action == "sft":
        from areal.core.sft import main as core_sft

        return core_sft(args.rest)
    if args.action == "status":
        from areal.core.async_ppo import format_status

        if len(args.rest) != 1:
            raise SystemExit(
                "areal core status RUN_DIR: give the run directory of an async-ppo run"
            )
        try:
            print(format_status(args.rest[0]))
        except FileNotFoundError as e:
            raise SystemExit(f"areal core status: {e}") from None
        return 0
    if args.action == "scale":
        return _core_scale(args.rest)
    if args.action in ("sync-ppo", "async-ppo"):  # the master under the local launcher (servers)
        import areal.core.async_ppo
        import areal.core.sync_ppo
        from areal.launcher.local import launch_local

        script = areal.core.sync_ppo if args.action == "sync-ppo" else areal.core.async_ppo
        return launch_local(script.__file__, args.rest)
    from areal.api.config import load_config
    from areal.core.dfg import GraphError, format_graph
    from areal.core.graphs import CoreGraphConfig, graph_from_config

    cfg = load_config(CoreGraphConfig, args.rest)
    try:
        print(format_graph(graph_from_config(cfg)))
    except GraphError as e:
        print(f"areal core {args.action}: {e}", file=sys.stderr)
        return 2
    return 0


def _add_local_artifacts(sub) -> None:
    """Subcommands that write a model or data locally: tiny-model, dpo-pairs."""
    p = sub.add_parser("tiny-model", help="write a tiny random Qwen2-style HF model directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="tiny ~3M, small ~25M")
    p.add_argument("--seed", type=int, default=0, help="init seed")
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser(
        "dpo-pairs", help="sample DPO preference pairs from a model on arithmetic (offline)"
    )
    p.add_argument("--model", required=True, help="HF model dir to sample from, e.g. the SFT model")
    p.add_argument("--out", required=True, help="output dir: train.jsonl, test.jsonl, summary.json")
    p.add_argument(
        "--config", help="YAML of ArithmeticPairsConfig fields (areal/dataset/arithmetic_pairs.py)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. n_samples=16")
    p.set_defaults(func=_dpo_pairs)


def _add_run_tools(sub) -> None:
    """Subcommands that look into a finished or running run dir: view, replay."""
    p = sub.add_parser(
        "view", help="a run viewer in the browser: curves, samples, tokens by version (loopback)"
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run dir(s); several are drawn in the same charts",
    )
    p.add_argument(
        "--port", type=int, default=8765, help="TCP port on 127.0.0.1 (0 = any free port)"
    )
    p.set_defaults(func=_view)

    p = sub.add_parser(
        "replay",
        help="re-run a recorded run's trainer on its own batches; check weights bit for bit",
    )
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run recorded with stats_logger.replay.enabled=true"
    )
    p.add_argument(
        "--to",
        type=int,
        default=None,
        metavar="STEP",
        help="replay steps 1..STEP (default: all); options go before RUN_DIR",
    )
    p.add_argument(
        "--script", default=None, help="entry script (default: the one that recorded the run)"
    )
    p.add_argument(
        "knobs",
        nargs="*",
        metavar="KEY=VALUE",
        help="change a knob, e.g. actor.optimizer.lr=1e-4: the divergence is reported, not an error",
    )
    p.set_defaults(func=_replay)


CORE_ACTIONS = (
    "graph: print nodes, edges, models and meshes; sft: SFT through the master; sync-ppo: sync "
    "PPO/GRPO through the master (servers started by the local launcher); async-ppo: async PPO/GRPO, "
    "rollout workers and the generation manager on Ray; status RUN_DIR: an async-ppo run's manager "
    "and rollout workers at its last step; scale RUN_DIR --rollout-workers N --add-server/"
    "--remove-server HOST:PORT: scale a running async-ppo job"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="areal", description="Asynchronous RL for LLM post-training on verifiable tasks."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_local_artifacts(sub)
    _add_run_tools(sub)
    p = sub.add_parser("quickstart", help="the embedded demo on this machine (CPU, no network)")
    p.add_argument("--out", default="runs/quickstart", help="output directory")
    p.add_argument(
        "--task",
        choices=["arithmetic", "tools"],
        default="arithmetic",
        help="arithmetic: answer directly; tools: a calculator agent (openai client) via workflow.type=agent",
    )
    p.add_argument(
        "--sft", action="append", default=[], metavar="KEY=VALUE", help="override for the SFT stage"
    )
    p.add_argument(
        "--grpo",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for the GRPO stage",
    )
    p.set_defaults(func=_quickstart)
    p = sub.add_parser("launch", help="start servers and trainers for an entry script")
    p.add_argument(
        "mode",
        choices=["local", "ray", "slurm"],
        help="where: local (this machine), ray (a Ray cluster), slurm (a batch job)",
    )
    p.add_argument("script", help="entry script, e.g. examples/gsm8k_grpo.py")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="--config YAML and key=value overrides")
    p.set_defaults(func=_launch)

    p = sub.add_parser("eval", help="held-out accuracy of a checkpoint (no training)")
    p.add_argument(
        "--model", required=True, help="HF model dir, e.g. RUN_DIR/checkpoints/actor/step200"
    )
    p.add_argument(
        "--config", help="the training YAML (valid_dataset, eval_gconfig, reward_fn, workflow)"
    )
    p.add_argument("--out", help="also write the JSON summary here")
    p.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. valid_dataset.size=100"
    )
    p.set_defaults(func=_eval)

    p = sub.add_parser("plot", help="plot reward, held-out accuracy and stage times of a run")
    p.add_argument("run_dir", help="RUN_DIR holding stats.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plot.png)")
    p.set_defaults(func=_plot)

    p = sub.add_parser(
        "config-docs", help="write the config reference (Markdown) from the dataclasses"
    )
    p.add_argument("--out", default="docs/config.md", help="output path; - for stdout")
    p.set_defaults(func=_config_docs)

    p = sub.add_parser("serve", help="generation server (SGLang native + OpenAI HTTP API)")
    p.add_argument("--model", help="Hugging Face model dir (= model_path=DIR)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 30000; 0 = any free port)")
    p.add_argument(
        "--api-key",
        dest="api_key",
        help="bearer key for admin endpoints; prefer the AREAL_SERVER_API_KEY env variable "
        "(a command line is visible to every user of the machine)",
    )
    p.add_argument("--config", help="YAML file of GenerationServerConfig fields")
    p.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. max_batch_size=64"
    )
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "core", help="Core mode (docs/core.md): print a dataflow graph, run SFT, sync or async PPO"
    )
    p.add_argument(
        "action",
        choices=["graph", "sft", "sync-ppo", "async-ppo", "status", "scale"],
        help=CORE_ACTIONS,
    )
    p.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        help="--config YAML and key=value overrides: CoreGraphConfig fields "
        "(areal/core/graphs.py) for graph, CoreSFTConfig fields (areal/core/sft.py) for sft, "
        "CoreGRPOConfig / CoreAsyncGRPOConfig fields (areal/core/config.py) for sync-ppo / async-ppo",
    )
    p.set_defaults(func=_core)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user error (bad config, a path that is not there) is one message
    and exit code 2, Ctrl-C one line and exit code 130, not a traceback."""
    from areal.api.config import ConfigError

    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (
        ConfigError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
    ) as e:
        print(f"areal {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a launch (a launch reports its own and returns 130)
        print(f"areal {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
