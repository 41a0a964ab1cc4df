"""Tier 1: chunked logprobs / entropy equal the plain log-softmax path, values and gradients."""

import pytest
import torch

from areal.algo.logprob import (
    fused_logprobs_and_entropy,
    logprobs_and_entropy,
    packed_token_logprobs,
)


def _plain(logits, labels, temperature):
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64
    logp_all = torch.log_softmax(wide / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def test_hand_worked_two_token_vocab():
    # logits [0, ln 3] -> p = [1/4, 3/4]; label 1 -> log(3/4) = -0.28768
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.34657 + 0.21576 = 0.56233
    logits = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]])
    logp, ent = logprobs_and_entropy(logits, torch.tensor([1]))
    assert torch.allclose(logp, torch.tensor([-0.287682]), atol=1e-6)
    assert torch.allclose(ent, torch.tensor([0.562335]), atol=1e-6)


def test_chunked_values_and_gradients_match_plain_path():
    torch.manual_seed(0)
    logits = torch.randn(23, 17, requires_grad=True)
    labels = torch.randint(0, 17, (23,))
    g1, g2 = torch.randn(23), torch.randn(23)
    for temperature in (1.0, 0.6):
        logp, ent = logprobs_and_entropy(logits, labels, temperature, chunk_size=5)
        ref_logp, ref_ent = _plain(logits, labels, temperature)
        assert torch.allclose(logp, ref_logp, atol=1e-5)
        assert torch.allclose(ent, ref_ent, atol=1e-5)
        grad = torch.autograd.grad((logp * g1 + ent * g2).sum(), logits)[0]
        ref_grad = torch.autograd.grad((ref_logp * g1 + ref_ent * g2).sum(), logits)[0]
        assert torch.allclose(grad, ref_grad, atol=1e-5)


def test_chunk_size_does_not_change_the_result():
    torch.manual_seed(1)
    logits, labels = torch.randn(10, 7), torch.randint(0, 7, (10,))
    a = logprobs_and_entropy(logits, labels, 1.0, chunk_size=1)
    b = logprobs_and_entropy(logits, labels, 1.0, chunk_size=100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_forward_keeps_no_vocab_sized_tensor_for_backward():
    logits = torch.randn(8, 50, requires_grad=True)
    logp, _ = logprobs_and_entropy(logits, torch.zeros(8, dtype=torch.long), chunk_size=2)
    saved = logp.grad_fn.saved_tensors
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # only the input itself


def test_packed_alignment_puts_logp_of_token_t_at_t_and_zero_at_sequence_starts():
    torch.manual_seed(2)
    input_ids = torch.tensor([3, 1, 4, 1, 5])  # sequences [3, 1, 4] and [1, 5]
    cu = torch.tensor([0, 3, 5])
    logits = torch.randn(5, 6)
    logp, ent = packed_token_logprobs(logits, input_ids, cu)
    full = torch.log_softmax(logits, -1)
    # token 1 (id 1) is predicted by row 0; token 2 (id 4) by row 1; token 4 (id 5) by row 3
    expected = torch.tensor([0.0, full[0, 1], full[1, 4], 0.0, full[3, 5]])
    assert torch.allclose(logp, expected, atol=1e-6)
    assert ent[0] == 0 and ent[3] == 0 and ent[1] > 0


def _head_case(seed=3, t=29, h=6, v=31, bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, b, labels


def test_fused_head_values_and_gradients_match_logits_path():
    # float64, so the comparison sees the maths, not the rounding
    for bias in (True, False):
        hidden, weight, b, labels = _head_case(bias=bias)
        params = [hidden, weight] + ([b] if b is not None else [])
        g1, g2 = torch.randn(29, dtype=torch.float64), torch.randn(29, dtype=torch.float64)
        for temperature in (1.0, 0.7):
            logp, ent = fused_logprobs_and_entropy(hidden, weight, b, labels, temperature, 4)
            logits = torch.nn.functional.linear(hidden, weight, b)
            ref_logp, ref_ent = _plain(logits.double(), labels, temperature)
            assert torch.allclose(logp, ref_logp, atol=1e-12)
            assert torch.allclose(ent, ref_ent, atol=1e-12)
            grads = torch.autograd.grad((logp * g1 + ent * g2).sum(), params)
            ref_grads = torch.autograd.grad((ref_logp * g1 + ref_ent * g2).sum(), params)
            for got, want in zip(grads, ref_grads):
                assert torch.allclose(got, want, atol=1e-10)


def test_fused_head_gives_a_tied_embedding_both_gradients():
    # a tied head: the same weight embeds the inputs and scores the vocabulary
    hidden, weight, _, labels = _head_case(bias=False)
    ids = torch.randint(0, 31, (29,))

    def loss(fused: bool):
        x = torch.nn.functional.embedding(ids, weight) + hidden  # [T, H]
        if fused:
            logp, _ = fused_logprobs_and_entropy(x, weight, None, labels, 1.0, 5)
        else:
            logp, _ = logprobs_and_entropy(x @ weight.t(), labels, 1.0, 5)
        return logp.sum()

    got = torch.autograd.grad(loss(True), weight)[0]
    want = torch.autograd.grad(loss(False), weight)[0]
    assert torch.allclose(got, want, atol=1e-10)


def test_fused_head_keeps_no_vocab_sized_tensor_for_backward():
    hidden, weight, _, labels = _head_case(t=64, h=4, v=100, bias=False, dtype=torch.float32)
    logp, _ = fused_logprobs_and_entropy(hidden, weight, None, labels, 1.0, 8)
    saved = [t for t in logp.grad_fn.saved_tensors if t is not None]
    assert max(t.numel() for t in saved) == weight.numel()  # the weight; no [T, V] tensor


def test_fused_head_refuses_mismatched_rows():
    hidden, weight, _, labels = _head_case(bias=False)
    with pytest.raises(ValueError, match="same number of rows"):
        fused_logprobs_and_entropy(hidden, weight, None, labels[:-1])
