"""``reward_fn`` -> the function: ``math`` (:func:`areal.reward.math.math_reward`), ``code``
(:func:`areal.reward.code.code_reward`), or ``module:function``, a function of yours imported
by path (a module beside the entry script, or anywhere on ``PYTHONPATH``).

A reward is ``fn(completion, reference) -> float``; one that also takes a ``prompt`` parameter
gets the prompt's text as ``prompt=`` (see :func:`wants_prompt`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from areal.api.config.reward import reward_fn_problem
from areal.utils.imports import import_by_path


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
    fn = import_by_path(spec, "reward_fn")
    if not callable(fn):
        raise ValueError(f"reward_fn: {spec} is a {type(fn).__name__}, not a function")
    return fn


def wants_prompt(fn: Callable) -> bool:
    """Whether ``fn`` takes a ``prompt`` parameter (then workflows pass the prompt's text)."""
    try:
        return "prompt" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
