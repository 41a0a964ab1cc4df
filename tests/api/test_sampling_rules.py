"""Tier 1: the shared sampling-field rules (areal.api.sampling) that the generation server and
the agent client both apply, and how a server's refusal reads back."""

from __future__ import annotations

import json

from areal.api.sampling import (
    FLOAT32_MAX,
    MAX_SEED,
    finite_in_float32,
    number_problems,
    rejected_reply,
    reward_problems,
    sampling_problems,
    stop_problems,
    stop_strings,
    token_problems,
)

VALID = dict(max_new_tokens=8, min_new_tokens=0, temperature=1.0, top_p=1.0, top_k=-1, seed=None)


def _fields(**change) -> list[str]:
    return [f for f, _ in sampling_problems(**{**VALID, **change})]


def test_out_of_range_sampling_fields_are_named():
    assert _fields() == []
    assert _fields(top_p=5.0) == ["top_p"] and _fields(top_p=0.0) == ["top_p"]
    assert _fields(top_p=float("nan")) == ["top_p"]
    assert _fields(seed=MAX_SEED + 1) == ["seed"] and _fields(seed=-1) == ["seed"]
    assert _fields(seed=MAX_SEED) == [] and _fields(seed=0) == []
    assert _fields(temperature=1e-5) == ["temperature"] and _fields(temperature=0.0) == []
    assert _fields(min_new_tokens=9) == ["min_new_tokens"]  # exceeds max_new_tokens 8
    assert _fields(max_new_tokens=-1, top_k=-2) == ["max_new_tokens", "top_k"]


def test_stop_must_be_strings_within_the_servers_limits():
    assert stop_problems(None, 4, 10) == [] and stop_problems("x", 4, 10) == []
    assert stop_problems([5], 4, 10)[0][1].startswith("expected a string or a list of strings")
    assert "server.max_stop_strings" in stop_problems(["a"] * 5, 4, 10)[0][1]
    assert "server.max_stop_chars" in stop_problems(["abcdef", "ghijk"], 4, 10)[0][1]
    assert stop_strings(["a", "", "b"]) == ("a", "b") and stop_strings("x") == ("x",)


def test_numbers_and_token_ids_are_typed():
    assert number_problems({"top_p": "high", "seed": 1.5, "n": True}, ("seed",)) == [
        ("top_p", "expected a number, got high"),
        ("seed", "expected an integer, got 1.5"),
        ("n", "expected a number, got True"),
    ]
    assert token_problems("prompt", [0, 9], 10) == []
    for bad in ([1000000], [-1], [True]):
        assert token_problems("prompt", bad, 10)[0][0] == "prompt"


def test_a_reward_must_stay_finite_in_float32():
    assert reward_problems("reward", 1.0) == [] and reward_problems("reward", -FLOAT32_MAX) == []
    for bad in (1e308, -1e39, float("nan"), float("inf"), 10**400, "1", None, True):
        assert reward_problems("reward", bad)[0][0] == "reward", bad


def test_finite_in_float32_agrees_with_torchs_cast_at_the_edge_of_the_range():
    import torch

    # just past float32's largest value still rounds down to it; 3.5e38 rounds to inf
    for value in (FLOAT32_MAX, FLOAT32_MAX * (1 + 2**-25), 3.5e38, -3.5e38, 1e308, 7, True):
        cast = bool(torch.isfinite(torch.tensor(float(value), dtype=torch.float32)))
        assert finite_in_float32(value) is cast, value
    assert not finite_in_float32("nan") and not finite_in_float32(None)


def test_a_servers_refusal_reads_back_with_its_message_field_and_status():
    ours = json.dumps({"error": {"message": "top_p: must be in (0, 1]", "param": "top_p"}})
    e = rejected_reply(400, ours, "s:1 (POST /generate)")
    assert e is not None and e.status == 400 and e.field == "top_p"
    assert str(e) == "s:1 (POST /generate) refused the request (HTTP 400): top_p: must be in (0, 1]"
    sglang = json.dumps({"object": "error", "message": "too long", "param": None, "code": 400})
    e = rejected_reply(400, sglang, "s:1")
    assert e is not None and e.field is None and str(e).endswith("too long")
    e = rejected_reply(413, "body too large", "s:1")
    assert e is not None and e.status == 413 and str(e).endswith("body too large")
    for status in (401, 403, 404, 408, 500):  # the run's configuration or the server's state
        assert rejected_reply(status, ours, "s:1") is None
