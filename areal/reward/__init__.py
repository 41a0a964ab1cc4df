"""Verifiable rewards and the process pool that runs them.

* :func:`areal.reward.math.math_reward` ``(completion, reference) -> 1.0 | 0.0``
* :func:`areal.reward.code.code_reward` ``(completion, tests, cfg) -> pass fraction | all-pass``
  (sandboxed: :mod:`areal.reward.sandbox`)
* :class:`areal.reward.runner.RewardRunner`: worker processes, per-call deadline, failure policy.
"""
