"""Datasets of the environment workflows (areal.workflow.envs; docs/environments.md).

* ``reasoning_gym:TASK[(KEY=VALUE,...)][:WEIGHT],...``: reasoning-gym's procedural tasks (each
  with its config's options, e.g. ``chain_sum(max_terms=2)``), generated here from the run seed
  (each split its own seed, so ``valid_dataset.split: test`` holds other items than ``train``),
  mixed by weight (default 1 each) over ``size`` items (default :data:`DEFAULT_SIZE`). Item: the
  question as the user message (+ the instruction), the reasoning-gym entry as ``reference``
  (what its scorer reads); ``type: sft`` adds the answer as the assistant turn.
* ``verifiers:module:function``: the tasks of the ``vf.Taskset`` the function returns.
* ``openenv``: ``size`` episodes for an OpenEnv environment: each item a reset seed and the
  instruction as the system message; the environment's first observation is the first user turn.

The same config and seed give the same items in the same order, so the loader's resume is exact
as for any other dataset. :func:`missing_extra` is the one line naming the ``envs`` extra.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import zlib
from typing import Any

from areal.api.config.data import DatasetConfig
from areal.utils.imports import import_by_path

DEFAULT_SIZE = 1000
RG_INSTRUCTION = "Give only the final answer inside <answer></answer> tags."
OPENENV_INSTRUCTION = (
    "You act in an environment. Each user message is its observation; answer with your action."
)

EXTRA_HINT = "pip install -e '.[envs]'"
# workflow.type -> the module it needs (the distribution's import name)
PACKAGES = {"reasoning_gym": "reasoning_gym", "openenv": "openenv", "verifiers": "verifiers"}


def missing_extra(workflow_type: str) -> str:
    """One line naming the extra when ``workflow_type``'s package is not installed, else ''."""
    module = PACKAGES.get(workflow_type)
    if module is None or importlib.util.find_spec(module) is not None:
        return ""
    return (
        f"workflow.type={workflow_type} needs the {module!r} package, which is not installed in "
        f"this interpreter; install the envs extra: {EXTRA_HINT}"
    )


def require(workflow_type: str) -> None:
    """Raise ImportError with :func:`missing_extra`'s line when the package is missing."""
    problem = missing_extra(workflow_type)
    if problem:
        raise ImportError(problem)


def is_env_dataset(path: str) -> bool:
    """Whether ``path`` names one of this module's datasets."""
    return path.startswith(("reasoning_gym:", "verifiers:")) or path == "openenv"


def split_seed(seed: int, split: str, name: str) -> int:
    """The generator seed of ``name``'s items in ``split``: distinct per split and task."""
    return (seed * 1_000_003 + zlib.crc32(f"{split}/{name}".encode())) % 2**31


_ENTRY = re.compile(r"(?P<name>\w+)(?:\((?P<kw>[^()]*)\))?(?::(?P<weight>[^:()]+))?")


def _top_level_split(spec: str) -> list[str]:
    """``spec`` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    return [p.strip() for p in [*parts, spec[start:]] if p.strip()]


def _value(text: str) -> Any:
    """A task option's value: a JSON number, bool or null as such, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tasks(spec: str) -> list[tuple[str, dict[str, Any], float]]:
    """``TASK[(KEY=VALUE,...)][:WEIGHT],...`` -> [(task, options, weight)]; ValueError naming
    the bad entry."""
    tasks = []
    for entry in _top_level_split(spec):
        m = _ENTRY.fullmatch(entry)
        try:
            weight = float(m["weight"]) if m and m["weight"] else 1.0
            pairs = [kv.split("=", 1) for kv in _top_level_split(m["kw"] or "")] if m else []
            options = {k.strip(): _value(v.strip()) for k, v in pairs}
        except ValueError:
            m = None
        if m is None or weight <= 0:
            raise ValueError(
                f"dataset path reasoning_gym:{spec}: entry {entry!r} is not "
                "TASK[(KEY=VALUE,...)][:WEIGHT] with a positive weight (e.g. "
                "reasoning_gym:chain_sum(max_terms=2),leg_counting:2)"
            )
        tasks.append((m["name"], options, weight))
    if not tasks:
        raise ValueError(
            "dataset path 'reasoning_gym:' names no task; e.g. reasoning_gym:chain_sum,leg_counting"
        )
    return tasks


def _counts(weights: list[float], size: int) -> list[int]:
    """Items per task: ``size`` split by weight (largest remainders), at least one each."""
    total = sum(weights)
    exact = [size * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: int(exact[i]) - exact[i])
    for i in order[: max(0, size - sum(counts))]:
        counts[i] += 1
    return counts


def reasoning_gym_items(spec: str, cfg: DatasetConfig, seed: int) -> list[dict[str, Any]]:
    """The items of ``reasoning_gym:spec`` (see the module docstring), tasks interleaved; for
    ``type: sft`` each ends with the answer in the instruction's tags as the assistant turn."""
    require("reasoning_gym")
    import reasoning_gym

    tasks = parse_tasks(spec)
    counts = _counts([w for _, _, w in tasks], cfg.size or DEFAULT_SIZE)
    per_task = []
    for (name, options, _), n in zip(tasks, counts):
        try:
            data = reasoning_gym.create_dataset(
                name, **options, size=n, seed=split_seed(seed, cfg.split, name)
            )
        except (KeyError, ValueError, TypeError, AssertionError) as e:
            raise ValueError(
                f"dataset path reasoning_gym:{spec}: reasoning-gym cannot make {name!r} with "
                f"{options} ({e!r}); see reasoning_gym.factory.DATASETS and the task's config"
            ) from None
        per_task.append([_rg_item(name, i, entry, cfg) for i, entry in enumerate(data)])
    longest = max(len(items) for items in per_task)
    return [items[k] for k in range(longest) for items in per_task if k < len(items)]


def _rg_item(name: str, i: int, entry: dict[str, Any], cfg: DatasetConfig) -> dict[str, Any]:
    instruction = cfg.instruction or RG_INSTRUCTION
    messages = [{"role": "user", "content": f"{entry['question']}\n{instruction}"}]
    if cfg.type == "sft":
        messages.append({"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"})
    return {
        "id": f"{name}/{cfg.split}/{i}",
        "messages": messages,
        "reference": {"task": name, "answer": entry["answer"], "entry": dict(entry)},
    }


def openenv_items(cfg: DatasetConfig, seed: int) -> list[dict[str, Any]]:
    """``size`` episodes (default :data:`DEFAULT_SIZE`): a reset seed and the instruction."""
    instruction = cfg.instruction or OPENENV_INSTRUCTION
    return [
        {
            "id": f"episode/{cfg.split}/{i}",
            "seed": split_seed(seed, cfg.split, str(i)),
            "messages": [{"role": "system", "content": instruction}],
            "reference": None,
        }
        for i in range(cfg.size or DEFAULT_SIZE)
    ]


def load_taskset(spec: str, split: str = "train") -> Any:
    """The ``vf.Taskset`` that ``spec`` (``module:function``) returns; ValueError naming
    ``workflow.env`` when it is not one."""
    import verifiers.v1 as vf

    fn = import_by_path(spec, "workflow.env")
    kw = {"split": split} if "split" in inspect.signature(fn).parameters else {}
    taskset = fn(**kw)
    if not isinstance(taskset, vf.Taskset):
        raise ValueError(
            f"workflow.env: {spec} returned a {type(taskset).__name__}, not a vf.Taskset"
        )
    return taskset


def prompt_messages(data: Any) -> list[dict[str, Any]]:
    """A task's opening messages in the openai format: its system prompt, then its prompt."""
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        out += [m.model_dump(exclude_none=True) for m in data.prompt or []]
    return out


def verifiers_items(spec: str, cfg: DatasetConfig) -> list[dict[str, Any]]:
    """The first ``size`` tasks (default :data:`DEFAULT_SIZE`) of the ``vf.Taskset`` that
    ``spec`` (``module:function``, called with ``split=`` when it takes one) returns, in its
    order: the task's opening messages and its data (the reference the workflow rebuilds the
    task from)."""
    require("verifiers")
    tasks = load_taskset(spec, cfg.split).take(cfg.size or DEFAULT_SIZE)
    return [
        {
            "id": f"{cfg.split}/{task.data.id or k}",
            "messages": prompt_messages(task.data),
            "reference": task.data.model_dump(mode="json"),
        }
        for k, task in enumerate(tasks)
    ]


def env_items(cfg: DatasetConfig, seed: int) -> list[dict[str, Any]]:
    """The items of an environment dataset path (:func:`is_env_dataset`)."""
    if cfg.path == "openenv":
        return openenv_items(cfg, seed)
    if cfg.path.startswith("verifiers:"):
        return verifiers_items(cfg.path.removeprefix("verifiers:"), cfg)
    return reasoning_gym_items(cfg.path.removeprefix("reasoning_gym:"), cfg, seed)
