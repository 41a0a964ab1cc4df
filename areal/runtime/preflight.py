"""Checks of what a config points at, run before any process starts: model dirs, dataset files,
the reward function's import path, and stop token ids against the model's vocabulary. Each
problem names the field, the value and the fix (a missing model dir otherwise costs a minute of
hub retries and a torch traceback)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import areal
from areal.api.config.base import GenerationHyperparameters
from areal.api.config.data import DatasetConfig
from areal.api.config.engine import TrainEngineConfig
from areal.api.config.reward import ENV_WORKFLOWS
from areal.reward.resolve import resolve_reward

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def _sections(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every dataclass section in the config tree, ``cfg`` included."""
    yield prefix, cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{prefix}{f.name}.")


def model_dir_problem(field: str, path: str) -> str | None:
    """Why ``path`` (config field ``field``) is not a local HF model dir; None if it is."""
    if not path:
        return None
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        what = "does not exist" if not d.exists() else "has no config.json"
        if "checkpoints" in d.parts:  # a training run's output: the run that writes it is missing
            export = f"{field}: {path!r} {what}; it is a training run's export"
            writer = _example_writing(d)
            if writer:  # an example's own path: that example's run writes it, not the demo
                return f"{export}, written by the run of examples/{writer}: run that first (the "\
                    "file's header says how), or pass a model a run wrote"  # fmt: skip
            # a teacher is a stronger model than the student: the demo's GRPO export, not its SFT
            which = (
                "its GRPO model to runs/quickstart/grpo/run/checkpoints/actor/step150"
                if field.endswith("teacher_path")
                else "its SFT model to runs/quickstart/sft/run/checkpoints/model/step300"
            )
            return (
                f"{export} (RUN_DIR/checkpoints/<name>/step<N>): run that stage first, or pass "
                f"the one a run wrote (`make demo` writes {which})"
            )
        return (
            f"{field}: {path!r} {what}; it must be a local Hugging Face model directory: one a run "
            "wrote (RUN_DIR/checkpoints/<name>/step<N>), `areal tiny-model --out DIR`, or a hub "
            "model (`hf download ORG/NAME --local-dir DIR`)"
        )
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        return f"{field}: {path!r} has config.json but no *.safetensors or *.bin weights"
    return None


def _example_writing(export: Path) -> str | None:
    """The examples/*.yaml whose run writes ``export`` (FILEROOT/EXPERIMENT/TRIAL/checkpoints/
    ...): the one whose experiment_name is EXPERIMENT; None when no example names it."""
    i = export.parts.index("checkpoints")
    if i < 2:
        return None
    line = re.compile(rf"^experiment_name:\s*{re.escape(export.parts[i - 2])}\s*(#.*)?$", re.M)
    examples = Path(areal.__file__).resolve().parents[1] / "examples"
    for yaml_file in sorted(examples.glob("*.yaml")):
        if line.search(yaml_file.read_text()):
            return yaml_file.name
    return None


def _vocab_size(path: str) -> int | None:
    try:
        return int(json.loads((Path(path).expanduser() / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def preflight(cfg: Any) -> list[str]:
    """Every problem with the paths and token ids ``cfg`` names (empty when it can start)."""
    problems: list[str | None] = []  # None / '': a check that found nothing
    for prefix, section in _sections(cfg):
        if isinstance(section, TrainEngineConfig):
            problems.append(model_dir_problem(f"{prefix}path", section.path))
        elif isinstance(section, DatasetConfig):
            p = section.path
            file_like = p.endswith(DATA_SUFFIXES) or p.startswith(("/", "./", "../", "~"))
            if p != "arithmetic" and file_like and not Path(p).expanduser().exists():
                problems.append(
                    f"{prefix}path: {p!r} does not exist; pass an existing .jsonl/.parquet "
                    "file, 'arithmetic', or a dataset id"
                )
    tok = getattr(cfg, "tokenizer_path", "")
    if tok and not (Path(tok).expanduser() / "tokenizer_config.json").is_file():
        problems.append(
            f"tokenizer_path: {tok!r} has no tokenizer_config.json; pass a local "
            "tokenizer (or model) directory, or leave it empty to use the model's"
        )
    problems += _workflow_problems(cfg)
    spec = getattr(cfg, "reward_fn", "")
    if spec and spec not in ("math", "code"):  # the user's function must import here already
        try:
            resolve_reward(spec)
        except ValueError as e:
            problems.append(str(e))
    vocab = _vocab_size(getattr(cfg, "served_model_path", "") or "")
    if vocab is not None:
        for prefix, section in _sections(cfg):
            if isinstance(section, GenerationHyperparameters):
                bad = [t for t in section.stop_token_ids if not 0 <= t < vocab]
                if bad:
                    problems.append(
                        f"{prefix}stop_token_ids: {bad[:3]} outside the model's vocabulary "
                        f"[0, {vocab}); use ids of the actor's tokenizer"
                    )
    problems.append(teacher_problem(cfg))
    problems.append(served_family_problem(cfg))
    return [p for p in problems if p]


def served_family_problem(cfg: Any) -> str:
    """The model the launcher's embedded generation servers would load must be of a family they
    serve (the servers refuse it at start otherwise, after the launch began); '' when fine, when
    another backend serves it, or when nothing is served."""
    rollout, cluster = getattr(cfg, "rollout", None), getattr(cfg, "cluster", None)
    path = getattr(cfg, "served_model_path", "") or ""
    if rollout is None or rollout.backend != "areal" or not getattr(cluster, "n_servers", 0):
        return ""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return ""  # a missing or unreadable model dir is model_dir_problem's to name
    from areal.serving.families import UnsupportedModel, architecture_of

    try:
        architecture_of(config)
    except UnsupportedModel as e:
        return f"actor.path: {path!r}: {e}"
    return ""


def _workflow_problems(cfg: Any) -> list[str]:
    """What is wrong with ``cfg.workflow``: the user's agent, program or workflow class must
    import before anything starts."""
    workflow = getattr(getattr(cfg, "workflow", None), "type", "rlvr")
    # The agent workflows' modules pull in torch, openai and the engine API (~2.3 s, 1.1 s of it
    # beyond torch): imported only when the run uses them, not by every launcher's check.
    if workflow == "agent":  # the user's agent function must import here already
        from areal.workflow.agent import load_agent

        try:
            load_agent(cfg.workflow.agent.path)
        except ValueError as e:
            return [str(e)]
    elif workflow == "agent_cmd":  # the agent program and its reward function must be found
        from areal.workflow.agent_cmd import command_problems

        return command_problems(cfg.workflow.agent)
    elif workflow in ENV_WORKFLOWS:  # the hub's package (the envs extra, in one line), its env
        from areal.workflow.envs import env_problems

        train = getattr(cfg, "train_dataset", None)
        return env_problems(cfg.workflow, train.path if train is not None else "")
    elif workflow not in ("rlvr", "multi_turn"):  # the user's class must import here already
        from areal.workflow.custom import workflow_class

        try:
            workflow_class(workflow)
        except ValueError as e:
            return [str(e)]
    return []


def teacher_problem(cfg: Any) -> str:
    """A distillation teacher (``distill.teacher_path``) must exist and share the student's
    tokenizer: its logprobs score the student's token ids ('' when fine or not distilling)."""
    distill = getattr(cfg, "distill", None)
    if distill is None or not distill.enabled:
        return ""
    missing = model_dir_problem("distill.teacher_path", distill.teacher_path)
    if missing:
        return missing
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.actor.path)
    teacher = AutoTokenizer.from_pretrained(distill.teacher_path)
    if student.get_vocab() != teacher.get_vocab():
        return (
            f"distill.teacher_path: {distill.teacher_path!r} has another tokenizer than the "
            f"student ({len(teacher)} vs {len(student)} tokens, or other ids); the teacher scores "
            "the student's token ids, so pick a teacher of the same tokenizer family"
        )
    return ""
