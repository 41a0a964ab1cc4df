"""KL estimators between the policy and a reference policy, per token (Schulman, "Approximating
KL divergence", 2020).

With ``log_ratio = logp - ref_logp`` for a token sampled from the policy:

- ``k1 = log_ratio``: unbiased, high variance, can be negative.
- ``k2 = log_ratio**2 / 2``: biased, low variance, always >= 0.
- ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased, low variance, always >= 0.

Departure from the note: k3 is computed on the log ratio clamped to [-20, 20] and the result
clamped to at most 10, so one token whose probabilities disagree wildly cannot dominate a batch
(the usual low-variance clamp in RLHF code; it is exact for |log_ratio| < ~2.5).
"""

from __future__ import annotations

import torch

K3_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """[T] per-token KL(policy || reference) estimate; gradients flow through both inputs."""
    log_ratio = logp - ref_logp  # [T]
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        r = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(-r) - 1.0 + r).clamp(max=K3_MAX)
    raise ValueError(f"kl_estimator: got {estimator!r}; use one of 'k1', 'k2', 'k3'")
