"""The ``areal`` command: one subcommand per user-facing job; each wires library calls only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypedDict, Unpack


def _tiny_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from areal.utils.tiny_model import build_tiny_model, count_parameters

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise NotADirectoryError(
            f"--out {args.out}: is a file, not a directory; pass a new or "
            "existing directory, e.g. --out models/tiny"
        )
    out = build_tiny_model(args.out, size=args.size, seed=args.seed, family=args.family)
    print(f"wrote {args.size} {args.family} model ({count_parameters(out):,} parameters) to {out}")
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
    from areal.utils.viewer import CannotStart, serve

    try:
        serve(args.run_dirs, args.port, args.host, allowed_hosts=args.allowed_hosts)
    except CannotStart as e:  # a taken port: one line naming it and --port, no traceback
        print(f"areal view: {e}", file=sys.stderr)
        return 2
    return 0


def _replay(args: argparse.Namespace) -> int:
    import importlib.util

    from areal.runtime.replay import replay_run
    from areal.runtime.replay_files import read_meta, replay_script

    try:  # a damaged record or a refused script is one line, never a traceback
        meta = read_meta(args.run_dir)
        script = replay_script(args.run_dir, meta, args.script, args.trust_run_dir)
    except ValueError as e:
        raise SystemExit(f"areal replay: {e}") from None
    spec = importlib.util.spec_from_file_location("areal_replayed_script", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"areal replay: {script} is not a Python file; pass --script PATH.py")
    module = importlib.util.module_from_spec(spec)
    # as `python SCRIPT` and the launcher do: modules beside the script import, and a dataclass
    # the script defines finds its module (dataclasses looks it up in sys.modules)
    if str(Path(script).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(script).resolve().parent))
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # CONFIG, setup_trainers, train_step: the code the user chose
    try:
        report = replay_run(
            args.run_dir,
            module.CONFIG,
            module.setup_trainers,
            module.train_step,
            to=args.to,
            knobs=tuple(args.knobs),
        )
    except ValueError as e:  # ReplayFileError too: a damaged step, hashes or weights file
        raise SystemExit(f"areal replay: {e}") from None
    print(report.text())
    # The verdict is the exit code (0 equal, 1 mismatch). The work is done and the process group
    # destroyed; interpreter teardown once aborted in torch's native threads under CI load
    # ("terminate called without an active exception", exit -6), turning a reported mismatch
    # into a crash. Flush and leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report.ok else 1)


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


def _tinker(args: argparse.Namespace) -> int:
    from areal.api.config import ConfigError, load_config
    from areal.api.config.tinker import TinkerConfig
    from areal.runtime.preflight import model_dir_problem
    from areal.tinker.routes import main as tinker_main

    p = argparse.ArgumentParser(prog=f"areal tinker {args.action}", description=TINKER_REST)
    p.add_argument("--model", help="Hugging Face model dir to train and sample (= model=DIR)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--config", help="YAML file of TinkerConfig fields")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    a = p.parse_intermixed_args(args.rest)
    argv = ["--config", a.config] if a.config else []
    argv += a.overrides  # the short flags below win over --config and dotted overrides
    argv += [f"{k}={json.dumps(getattr(a, k))}" for k in ("model", "host", "port")]
    cfg = load_config(TinkerConfig, [x for x in argv if not x.endswith("=null")])
    if not cfg.model:
        raise ConfigError(["model: empty; pass --model DIR (a Hugging Face model directory)"])
    problem = model_dir_problem("model", cfg.model)
    if problem:
        raise ConfigError([problem])
    return tinker_main(cfg)


def _config_docs(args: argparse.Namespace) -> int:
    from areal.config_docs import main as config_docs_main

    return config_docs_main([args.out])


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
    from areal.core.status import request_scale

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


def _core_stop(argv: list[str]) -> int:
    from areal.core.status import request_stop

    p = argparse.ArgumentParser(
        prog="areal core stop",
        description="Stop a running `areal core async-ppo` job early: the master makes its next "
        "step the last, saves and evaluates there, writes a recover checkpoint when recovery is "
        "on, and ends (docs/core.md).",
    )
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    try:
        request_stop(a.run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"areal core stop: {e}") from None
    print("requested; the master ends the run after its next step")
    return 0


def _core_status(argv: list[str]) -> int:
    from areal.core.status import format_status

    p = argparse.ArgumentParser(
        prog="areal core status",
        description="An `areal core async-ppo` run's manager and rollout workers at its last "
        "step (docs/core.md).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of an async-ppo run")
    a = p.parse_args(argv)
    try:
        print(format_status(a.run_dir))
    except FileNotFoundError as e:
        raise SystemExit(f"areal core status: {e}") from None
    return 0


def _core(args: argparse.Namespace) -> int:
    if args.action == "sft":
        from areal.core.sft import main as core_sft

        return core_sft(args.rest)
    if args.action == "status":
        return _core_status(args.rest)
    if args.action == "scale":
        return _core_scale(args.rest)
    if args.action == "stop":
        return _core_stop(args.rest)
    if args.action in ("sync-ppo", "async-ppo"):  # the master under the local launcher (servers)
        from areal.launcher.local import launch_local

        # the script's path only: importing it would load torch and Ray in the launcher
        script = Path(__file__).parent / "core" / f"{args.action.replace('-', '_')}.py"
        return launch_local(str(script), args.rest)
    from areal.api.config import load_config
    from areal.core.dfg import GraphError
    from areal.core.graphs import CoreGraphConfig, describe_graph

    cfg = load_config(CoreGraphConfig, args.rest)
    try:
        print(describe_graph(cfg))
    except GraphError as e:
        print(f"areal core {args.action}: {e}", file=sys.stderr)
        return 2
    return 0


CORE_ACTIONS = (
    "graph: print nodes, edges, models and meshes; sft: SFT through the master; sync-ppo: sync "
    "PPO/GRPO through the master (servers started by the local launcher); async-ppo: async "
    "PPO/GRPO, rollout workers and the generation manager on Ray; status RUN_DIR: an async-ppo "
    "run's manager and rollout workers at its last step; scale RUN_DIR --rollout-workers N "
    "--add-server/--remove-server HOST:PORT: scale a running async-ppo job; stop RUN_DIR: end "
    "it after its next step (saved, evaluated, a recover checkpoint when recovery is on)"
)
CORE_REST = (
    "--config YAML and key=value overrides: CoreGraphConfig fields (areal/core/graphs.py) for "
    "graph, CoreSFTConfig fields (areal/core/sft.py) for sft, CoreGRPOConfig / "
    "CoreAsyncGRPOConfig fields (areal/core/config.py) for sync-ppo / async-ppo"
)


TINY_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")  # tiny_model.FAMILIES, without torch


class ArgKeywords(TypedDict, total=False):
    """The keywords of ``ArgumentParser.add_argument`` that the table uses."""

    action: str
    choices: list[str]
    default: object
    dest: str
    help: str
    metavar: str
    nargs: str
    required: bool
    type: Callable[[str], object]


Arg = tuple[tuple[str, ...], ArgKeywords]  # add_argument's flags and keywords


def _arg(*flags: str, **kw: Unpack[ArgKeywords]) -> Arg:
    """One argument of a subcommand: what ``add_argument(*flags, **kw)`` takes."""
    return flags, kw


def _overrides(example: str) -> Arg:
    """The trailing ``key=value`` overrides of a config-driven subcommand."""
    return _arg("overrides", nargs="*", help=f"dotted key=value overrides, e.g. {example}")


class Command(NamedTuple):
    """One subcommand: its name, one-line help, the handler it runs and its arguments."""

    name: str
    help: str
    func: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...]


TINKER_REST = "--model DIR [--host ADDR] [--port P] [--config YAML] [key=value ...] (TinkerConfig)"
# fmt: off
COMMANDS: tuple[Command, ...] = (
    Command("tiny-model", "write a tiny random HF model directory (Qwen2, Qwen3, Llama 3, "
            "Qwen3-MoE)", _tiny_model, (
        _arg("--out", required=True, help="output directory"),
        _arg("--size", choices=["tiny", "small"], default="tiny", help="tiny ~3M, small ~25M"),
        _arg("--family", choices=list(TINY_FAMILIES), default="qwen2",
             help="architecture (areal/utils/tiny_model.py); the embedded generation server "
                  "serves each"),
        _arg("--seed", type=int, default=0, help="init seed"),
    )),
    Command("dpo-pairs", "sample DPO preference pairs from a model on arithmetic (offline)",
            _dpo_pairs, (
        _arg("--model", required=True, help="HF model dir to sample from, e.g. the SFT model"),
        _arg("--out", required=True, help="output dir: train.jsonl, test.jsonl, summary.json"),
        _arg("--config",
             help="YAML of ArithmeticPairsConfig fields (areal/dataset/arithmetic_pairs.py)"),
        _overrides("n_samples=16"),
    )),
    Command("view", "a run viewer in the browser: curves, samples, tokens by version (loopback)",
            _view, (
        _arg("run_dirs", nargs="+", metavar="RUN_DIR",
             help="run dir(s); several are drawn in the same charts"),
        _arg("--port", type=int, default=8765, help="TCP port (0 = any free port)"),
        _arg("--host", default="127.0.0.1", metavar="ADDR",
             help="address to listen on (default loopback; another one, e.g. 0.0.0.0, lets "
                  "anyone who reaches it read the run: prefer an SSH tunnel, docs/viewer.md)"),
        _arg("--allowed-host", dest="allowed_hosts", action="append", default=[], metavar="NAME",
             help="a host name the browser may reach the viewer by besides loopback names "
                  "(a proxy's name; repeatable; '*' = any; docs/security.md)"),
    )),
    Command("replay",
            "re-run a recorded run's trainer on its own batches; check weights bit for bit",
            _replay, (
        _arg("run_dir", metavar="RUN_DIR",
             help="a run recorded with stats_logger.replay.enabled=true"),
        _arg("--to", type=int, default=None, metavar="STEP",
             help="replay steps 1..STEP (default: all); options go before RUN_DIR"),
        _arg("--script", default=None,
             help="run this entry script (one you trust, e.g. examples/gsm8k_grpo.py)"),
        _arg("--trust-run-dir", action="store_true",
             help="run the run dir's own recorded copy of its script (RUN_DIR/replay/script.py): "
                  "only for a run dir you trust, as it runs that code"),
        _arg("knobs", nargs="*", metavar="KEY=VALUE",
             help="change a knob, e.g. actor.optimizer.lr=1e-4: the divergence is reported, "
                  "not an error"),
    )),
    Command("quickstart", "the embedded demo on this machine (CPU, no network)", _quickstart, (
        _arg("--out", default="runs/quickstart", help="output directory"),
        _arg("--task", choices=["arithmetic", "tools"], default="arithmetic",
             help="arithmetic: answer directly; tools: a calculator agent (openai client) via "
                  "workflow.type=agent"),
        _arg("--sft", action="append", default=[], metavar="KEY=VALUE",
             help="override for the SFT stage"),
        _arg("--grpo", action="append", default=[], metavar="KEY=VALUE",
             help="override for the GRPO stage"),
    )),
    Command("launch", "start servers and trainers for an entry script", _launch, (
        _arg("mode", choices=["local", "ray", "slurm"],
             help="where: local (this machine), ray (a Ray cluster), slurm (a batch job)"),
        _arg("script", help="entry script, e.g. examples/gsm8k_grpo.py"),
        _arg("rest", nargs=argparse.REMAINDER, help="--config YAML and key=value overrides"),
    )),
    Command("eval", "held-out accuracy of a checkpoint (no training)", _eval, (
        _arg("--model", required=True,
             help="HF model dir, e.g. RUN_DIR/checkpoints/actor/step200"),
        _arg("--config",
             help="the training YAML (valid_dataset, eval_gconfig, reward_fn, workflow)"),
        _arg("--out", help="also write the JSON summary here"),
        _overrides("valid_dataset.size=100"),
    )),
    Command("plot", "plot reward, held-out accuracy and stage times of a run", _plot, (
        _arg("run_dir", help="RUN_DIR holding stats.jsonl"),
        _arg("--out", default=None, help="PNG path (default RUN_DIR/plot.png)"),
    )),
    Command("config-docs", "write the config reference (Markdown) from the dataclasses",
            _config_docs, (
        _arg("--out", default="docs/config.md", help="output path; - for stdout"),
    )),
    Command("serve", "generation server (SGLang native + OpenAI HTTP API)", _serve, (
        _arg("--model", help="Hugging Face model dir (= model_path=DIR)"),
        _arg("--host", help="bind address (default 127.0.0.1)"),
        _arg("--port", type=int, help="TCP port (default 30000; 0 = any free port)"),
        _arg("--api-key", dest="api_key",
             help="bearer key for admin endpoints; prefer the AREAL_SERVER_API_KEY env variable "
                  "(a command line is visible to every user of the machine)"),
        _arg("--config", help="YAML file of GenerationServerConfig fields"),
        _overrides("max_batch_size=64"),
    )),
    Command("tinker", "a Tinker-compatible training service: the tinker SDK and cookbook "
            "against our trainer and generator (docs/tinker.md)", _tinker, (
        _arg("action", choices=["serve"], help="serve: run the service"),
        _arg("rest", nargs=argparse.REMAINDER, help=TINKER_REST),
    )),
    Command("core",
            "Core mode (docs/core.md): print a dataflow graph, run SFT, sync or async PPO",
            _core, (
        _arg("action", choices=["graph", "sft", "sync-ppo", "async-ppo", "status", "scale", "stop"],
             help=CORE_ACTIONS),
        _arg("rest", nargs=argparse.REMAINDER, help=CORE_REST),
    )),
)
# fmt: on


# one example per subcommand, shown under its --help
EXAMPLES = {
    "tiny-model": "areal tiny-model --out models/tiny-qwen3 --family qwen3",
    "dpo-pairs": "areal dpo-pairs --model SFT_MODEL_DIR --out data/pairs n_samples=16",
    "view": "areal view runs/quickstart/grpo/run",
    "replay": "areal replay --trust-run-dir --to 3 RUN_DIR",
    "quickstart": "areal quickstart --out runs/quickstart",
    "launch": "areal launch local examples/gsm8k_grpo.py --config examples/arithmetic_grpo.yaml "
    "total_train_steps=20   (--help after the script: its config's fields)",
    "eval": "areal eval --model RUN_DIR/checkpoints/actor/step200 --config "
    "examples/arithmetic_grpo.yaml",
    "plot": "areal plot runs/quickstart/grpo/run",
    "config-docs": "areal config-docs --out docs/config.md",
    "serve": "areal serve --model runs/quickstart/model --port 30000 max_batch_size=64",
    "tinker": "areal tinker serve --model runs/tiny --port 8000   (then TINKER_BASE_URL="
    "http://127.0.0.1:8000 TINKER_API_KEY=tml-local python your_tinker_script.py)",
    "core": "areal core graph graph=sync_ppo   (--help after an action: its config's fields or "
    "arguments)",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``areal`` parser: one subparser per row of :data:`COMMANDS`."""
    from areal import __version__

    parser = argparse.ArgumentParser(
        prog="areal", description="Asynchronous RL for LLM post-training on verifiable tasks."
    )
    parser.add_argument("--version", action="version", version=f"areal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help[0].upper() + command.help[1:] + ".",
            epilog=f"example: {EXAMPLES[command.name]}",
        )
        for flags, kw in command.args:
            p.add_argument(*flags, **kw)
        p.set_defaults(func=command.func)
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
