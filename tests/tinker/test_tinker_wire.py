"""Tinker wire format and losses (tier 1): the SDK's own encoders and decoders against ours, the
losses against hand-worked numbers, and the checks that name the bad field."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from areal.tinker.losses import elementwise_loss, target_logprobs
from areal.tinker.wire import (
    ApiError,
    Sequence,
    check_forward_backward,
    decode_forward_backward,
    encode_forward_backward,
    encode_sample,
)


def sdk_request(data: list, loss_fn: str = "cross_entropy", config=None) -> bytes:
    """The body the SDK sends for forward_backward(data, loss_fn, config)."""
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="run-x",
        seq_id=3,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_forward_backward_request_decodes_tokens_inputs_and_config():
    body = sdk_request(
        [
            datum(
                [5, 6, 7],
                target_tokens=[6, 7, 8],
                logprobs=[-1.0, -2.0, -0.5],
                advantages=[1.0, 0.0, -1.0],
            ),
            datum([9], target_tokens=[10], logprobs=[-3.0], advantages=[2.0]),
        ],
        "ppo",
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    )
    req = decode_forward_backward(body)
    assert (req.model_id, req.seq_id, req.loss_fn) == ("run-x", 3, "ppo")
    assert req.config == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert req.data[0].tokens.tolist() == [5, 6, 7] and req.n_tokens == 4
    assert req.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert req.data[0].inputs["advantages"].tolist() == [1.0, 0.0, -1.0]
    check_forward_backward(req, vocab_size=16, max_batch_tokens=4)  # valid: no error


def test_outputs_decode_with_the_sdk():
    outputs = [
        {"logprobs": np.array([-1.0, -2.5], np.float32), "elementwise_loss": np.zeros(2)},
        {"logprobs": np.array([-0.25], np.float32), "elementwise_loss": np.ones(1)},
    ]
    got = deserialize_forward_backward_output(encode_forward_backward(outputs, {"loss:sum": 4.0}))
    assert got.metrics == {"loss:sum": 4.0}
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    assert got.loss_fn_outputs[1]["elementwise_loss"].tolist() == [1.0]

    seqs = [Sequence([3, 4], [-0.5, -1.5], stopped=True), Sequence([7], [-2.0], stopped=False)]
    sample = deserialize_sample_response(encode_sample(seqs, [None, -0.75, -1.25]))
    assert [s.tokens for s in sample.sequences] == [[3, 4], [7]]
    assert [s.logprobs for s in sample.sequences] == [[-0.5, -1.5], [-2.0]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.prompt_logprobs == [None, -0.75, -1.25]


def test_losses_match_hand_worked_values():
    # softmax([0, ln 3]) = [1/4, 3/4]: target 1 -> ln 0.75, target 0 -> ln 0.25
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp = target_logprobs(logits, torch.tensor([1, 0]), chunk=1)
    assert logp.tolist() == pytest.approx([math.log(0.75), math.log(0.25)])
    # cross_entropy: -(w * logp) = [-(1 * -1), -(0.5 * -2)] = [1, 1]
    ce = elementwise_loss(
        "cross_entropy", torch.tensor([-1.0, -2.0]), {"weights": torch.tensor([1.0, 0.5])}, {}
    )
    assert ce.tolist() == [1.0, 1.0]
    # ratio = exp(ln 0.5 - ln 0.25) = 2, then 0.5; advantages 3, -1
    inputs = {
        "logprobs": torch.tensor([math.log(0.25), math.log(0.5)]),
        "advantages": torch.tensor([3.0, -1.0]),
    }
    now = torch.tensor([math.log(0.5), math.log(0.25)])
    # importance_sampling: -(r * A) = [-6, 0.5]
    assert elementwise_loss("importance_sampling", now, inputs, {}).tolist() == pytest.approx(
        [-6.0, 0.5]
    )
    # ppo, ratio clipped to [0.8, 1.2]: -min(2*3, 1.2*3) = -3.6; -min(0.5*-1, 0.8*-1) = 0.8
    assert elementwise_loss("ppo", now, inputs, {}).tolist() == pytest.approx([-3.6, 0.8])
    # a wider clip: -min(6, 1.5*3) = -4.5; -min(-0.5, 0.5*-1) = 0.5
    wide = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    assert elementwise_loss("ppo", now, inputs, wide).tolist() == pytest.approx([-4.5, 0.5])


@pytest.mark.parametrize(
    "data, loss_fn, match",
    [
        (
            [datum([1, 2], weights=[1.0, 1.0])],
            "cross_entropy",
            r"data\[0\]\.loss_fn_inputs\.target_tokens: missing",
        ),
        (
            [datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0])],
            "cross_entropy",
            r"data\[0\]\.loss_fn_inputs\.weights: 2 values for 3 model_input tokens",
        ),
        (
            [
                datum([1, 2], target_tokens=[2, 3]),
                datum([1], target_tokens=[2], logprobs=[-1.0], advantages=[float("nan")]),
            ],
            "importance_sampling",
            r"data\[0\]\.loss_fn_inputs\.logprobs: missing",
        ),
        (
            [datum([1], target_tokens=[2], logprobs=[-1.0], advantages=[float("nan")])],
            "importance_sampling",
            r"data\[0\]\.loss_fn_inputs\.advantages: nan at position 0",
        ),
        (
            [datum([1, 2], target_tokens=[2, 99])],
            "cross_entropy",
            r"data\[0\]\.loss_fn_inputs\.target_tokens: token ids must be in \[0, 16\)",
        ),
        (
            [datum(list(range(9)), target_tokens=list(range(9)))],
            "cross_entropy",
            r"data: 9 tokens in one request, over tinker\.max_batch_tokens=8",
        ),
        ([datum([1], target_tokens=[2])], "dro", r"loss_fn: 'dro' is not served here"),
    ],
)
def test_bad_datums_name_the_field(data, loss_fn, match):
    req = decode_forward_backward(sdk_request(data, loss_fn))
    with pytest.raises(ApiError, match=match) as info:
        check_forward_backward(req, vocab_size=16, max_batch_tokens=8)
    assert info.value.status == 400
