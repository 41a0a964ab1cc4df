"""Preference losses on (chosen, rejected) pairs: DPO (sigmoid), IPO and SimPO.

Inputs are per-sequence sums of completion-token logprobs (the prompt is not scored), one entry
per pair, all ``[P]``: ``logp_c`` / ``logp_r`` under the policy being trained, ``ref_c`` /
``ref_r`` under the frozen reference, and completion lengths ``len_c`` / ``len_r`` in tokens.

- **sigmoid** (DPO, Rafailov et al. 2023): ``h = beta * ((logp_c - ref_c) - (logp_r - ref_r))``,
  ``loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)``. ``eps`` is label smoothing:
  the conservative DPO of Mitchell (2023), which assumes a fraction ``eps`` of the labels are
  flipped; ``eps = 0`` is plain DPO.
- **ipo** (Azar et al. 2023): ``h = (logp_c - ref_c) - (logp_r - ref_r)``,
  ``loss = (h - 1 / (2 beta))^2``: a squared loss that pulls the log-ratio gap to a finite target
  instead of pushing it to infinity (no label smoothing: the target already bounds it).
- **simpo** (Meng et al. 2024): length-normalised and reference-free,
  ``h = beta * (logp_c / len_c - logp_r / len_r) - gamma``, then the sigmoid loss above
  (label smoothing allowed). ``gamma`` is the target reward margin.

Optional NLL term (``nll_coef`` > 0; the RPO regulariser of Pang et al. 2024): each pair's loss
gains ``nll_coef * (-logp_c / len_c)``, the mean token negative log-likelihood of the chosen
reply. DPO alone only widens the chosen-minus-rejected gap and may lower both sides' likelihood
(it did on the arithmetic demo: chosen answers lost probability and greedy accuracy fell); the
NLL term keeps pushing the chosen answers up.

Implicit rewards (for stats): ``beta * (logp - ref)`` per side for sigmoid and ipo,
``beta * logp / len`` for simpo. ``reward_acc`` is the fraction of pairs whose chosen reward is
above the rejected one, ``margin`` the mean chosen-minus-rejected reward.

Departures from the papers: none in the losses; sums over completion tokens only (the prompt
is shared by both sides and would cancel in sigmoid/ipo anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "simpo")


@dataclass(frozen=True)
class PairLogps:
    """Per-pair sums of completion-token logprobs and completion lengths, each ``[P]``.

    ``ref_c`` / ``ref_r`` are None for reference-free losses (simpo)."""

    logp_c: torch.Tensor
    logp_r: torch.Tensor
    len_c: torch.Tensor
    len_r: torch.Tensor
    ref_c: torch.Tensor | None = None
    ref_r: torch.Tensor | None = None


def implicit_rewards(
    pairs: PairLogps, loss_type: str, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P]) implicit rewards (see the module docstring)."""
    if loss_type == "simpo":
        return beta * pairs.logp_c / pairs.len_c.clamp(
            min=1
        ), beta * pairs.logp_r / pairs.len_r.clamp(min=1)
    if pairs.ref_c is None or pairs.ref_r is None:
        raise ValueError(
            f"loss_type={loss_type!r} needs reference logprobs (ref_c, ref_r); "
            "compute them with the reference model, or use loss_type='simpo'"
        )
    return beta * (pairs.logp_c - pairs.ref_c), beta * (pairs.logp_r - pairs.ref_r)


def preference_loss(
    pairs: PairLogps,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    nll_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses ``[P]`` and the (chosen, rejected) implicit rewards ``[P]`` (detached).

    ``loss_type`` is one of :data:`LOSS_TYPES`; ``beta`` > 0; ``label_smoothing`` in [0, 0.5)
    (sigmoid and simpo only); ``gamma`` is SimPO's margin (simpo only); ``nll_coef`` >= 0 weighs
    the chosen reply's mean token NLL (any loss type)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} is not defined for ipo; set it to 0")
    if not nll_coef >= 0:
        raise ValueError(f"nll_coef must be >= 0, got {nll_coef}")
    if gamma and loss_type != "simpo":
        raise ValueError(
            f"gamma={gamma} is SimPO's margin; set it to 0 for loss_type={loss_type!r}"
        )
    chosen, rejected = implicit_rewards(pairs, loss_type, beta)  # differentiable
    if loss_type == "ipo":
        gap = (pairs.logp_c - pairs.ref_c) - (pairs.logp_r - pairs.ref_r)
        losses = (gap - 1.0 / (2.0 * beta)) ** 2
    else:
        h = chosen - rejected - gamma  # gamma is 0 for sigmoid
        losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    if nll_coef:
        losses = losses + nll_coef * chosen_nll(pairs)
    return losses, chosen.detach(), rejected.detach()


def chosen_nll(pairs: PairLogps) -> torch.Tensor:
    """[P] mean token negative log-likelihood of each chosen reply: ``-logp_c / len_c``."""
    return -pairs.logp_c / pairs.len_c.clamp(min=1)


def reward_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Means over pairs: ``reward_acc`` (chosen > rejected), ``margin``, ``chosen_reward``,
    ``rejected_reward``."""
    chosen, rejected = chosen.detach().double(), rejected.detach().double()
    return {
        "reward_acc": float((chosen > rejected).double().mean()),
        "margin": float((chosen - rejected).mean()),
        "chosen_reward": float(chosen.mean()),
        "rejected_reward": float(rejected.mean()),
    }
