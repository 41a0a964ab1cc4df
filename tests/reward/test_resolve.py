"""reward_fn -> function: the built-in names, an import path, and each way it can be wrong."""

from __future__ import annotations

import sys

import pytest

from areal.api.config.reward import reward_fn_problem
from areal.reward.resolve import resolve_reward, wants_prompt


def test_builtin_names_and_an_import_path_resolve(tmp_path, monkeypatch):
    from areal.reward.code import code_reward
    from areal.reward.math import math_reward

    (tmp_path / "my_rewards_t.py").write_text(
        "def r(completion, reference, prompt):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("math") is math_reward and resolve_reward("code") is code_reward
    fn = resolve_reward("my_rewards_t:r")
    assert fn("a", "b", prompt="c") == 1.0 and wants_prompt(fn) and not wants_prompt(math_reward)
    sys.modules.pop("my_rewards_t", None)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("maths", "is not 'math', 'code' or an import path"),
        ("a.b", "is not 'math', 'code' or an import path"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("json:no_such_function", "json has no 'no_such_function'"),
    ],
)
def test_a_bad_reward_fn_names_the_field_the_value_and_the_fix(spec, message):
    with pytest.raises(ValueError, match="reward_fn") as e:
        resolve_reward(spec)
    assert message in str(e.value)
    assert (reward_fn_problem(spec) is None) == (":" in spec)  # the form is checked at config load
