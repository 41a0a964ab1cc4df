"""RL algorithms as pure tensor functions on packed batches (no engines, no I/O).

The training engine calls two entry points, both configured by
:class:`areal.api.config.actor.PPOActorConfig`:

- :func:`compute_advantages` (advantages.py): rewards [B] + loss_mask [T] (+ values, logprobs,
  reference logprobs) -> advantages and returns [T];
- :func:`policy_loss` (losses.py): logprobs, proximal / behaviour logprobs, advantages ->
  (scalar loss, stats), with normalisers from :func:`loss_normalisers`.

Around them: logprob.py (chunked logprobs and entropy from logits), kl.py, reward_shaping.py
(incl. the dynamic-sampling test), critic.py (value loss, value normalisation).
"""

from areal.algo.advantages import Advantages, compute_advantages
from areal.algo.critic import ValueNormalizer, value_loss
from areal.algo.logprob import packed_token_logprobs
from areal.algo.losses import loss_normalisers, policy_loss
from areal.algo.reward_shaping import uniform_reward_groups

__all__ = [
    "Advantages",
    "ValueNormalizer",
    "compute_advantages",
    "loss_normalisers",
    "packed_token_logprobs",
    "policy_loss",
    "uniform_reward_groups",
    "value_loss",
]
