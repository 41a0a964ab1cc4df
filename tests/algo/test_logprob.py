"""Tier 1: chunked logprobs / entropy equal the plain log-softmax path, values and gradients."""

import torch

from areal.algo.logprob import logprobs_and_entropy, packed_token_logprobs


def _plain(logits, labels, temperature):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
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
