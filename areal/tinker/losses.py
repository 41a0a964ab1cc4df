"""The Tinker API's built-in losses, per token, as the Tinker documentation defines them.

Position ``i`` of a datum scores ``target_tokens[i]`` from the logits at ``i``. Every loss is a
*sum* over tokens (the API's convention: the client weights tokens itself, e.g. ``weights =
1 / n`` for a mean), so gradients of several ``forward_backward`` calls before one
``optim_step`` add up exactly as one big call's would.

- ``cross_entropy``: ``-(weights * logp).sum()`` (``weights`` default 1).
- ``importance_sampling``: ``-(exp(logp - logprobs) * advantages).sum()``; ``logprobs`` are the
  sampler's.
- ``ppo``: ``-min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A).sum()`` with
  ``r = exp(logp - logprobs)``; the thresholds bound the ratio itself (defaults 0.8 and 1.2).
"""

from __future__ import annotations

import torch

PPO_CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``log softmax(logits[i])[targets[i]]`` for each row; logits ``[N, V]``, targets ``[N]``.

    Rows go ``chunk`` at a time, so the fp32 log-softmax of the whole ``[N, V]`` is never held."""
    out = []
    for s in range(0, logits.shape[0], chunk):
        rows = logits[s : s + chunk].float()
        picked = rows.gather(-1, targets[s : s + chunk, None].long())[:, 0]
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out) if out else logits.new_zeros(0)


def elementwise_loss(
    loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """The per-token loss ``[N]`` of ``loss_fn`` (its sum is the request's loss)."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -logp if weights is None else -(weights * logp)
    ratio = torch.exp(logp - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(ratio * advantages)
    if loss_fn == "ppo":
        cfg = {**PPO_CLIP_DEFAULTS, **config}
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.minimum(ratio * advantages, clipped * advantages)
    raise ValueError(f"loss_fn {loss_fn!r} has no built-in definition")
