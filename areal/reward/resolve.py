"""``reward_fn`` -> the function: ``math`` (:func:`areal.reward.math.math_reward`), ``code``
(:func:`areal.reward.code.code_reward`), or ``module:function``, a function of yours imported
by path (a module beside the entry script, or anywhere on ``PYTHONPATH``).

A reward is ``fn(completion, reference) -> float``; one that also takes a ``prompt`` parameter
gets the prompt's text as ``prompt=`` (see :func:`wants_prompt`)."""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

from areal.api.config.reward import reward_fn_problem


def resolve_reward(spec: str) -> Callable[..., float]:
    """The reward function ``spec`` names; ValueError naming ``reward_fn``, the value and the
    fix when it cannot be imported or is not callable."""
    if spec == "math":
        from areal.reward.math import math_reward

        return math_reward
    if spec == "code":
        from areal.reward.code import code_reward

        return code_reward
    problem = reward_fn_problem(spec)
    if problem:
        raise ValueError(problem)
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward_fn: cannot import {module_name!r} ({e}); put {module_name}.py beside "
                         "the entry script or on PYTHONPATH") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn: {module_name} has no function {name!r} "
                         f"(found: {sorted(n for n in vars(module) if not n.startswith('_'))[:10]})")
    return fn


def wants_prompt(fn: Callable) -> bool:
    """Whether ``fn`` takes a ``prompt`` parameter (then workflows pass the prompt's text)."""
    try:
        return "prompt" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
