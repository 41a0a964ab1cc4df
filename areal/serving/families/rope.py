"""Rotary position embeddings: the inverse frequencies of the ``default`` and ``llama3`` rope
types, computed as ``transformers`` computes them (``modeling_rope_utils``), so the served model's
angles equal the trainer's bit for bit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal.serving.families.base import refuse

if TYPE_CHECKING:  # torch is imported by inv_freq: a launcher's preflight reads configs only
    import torch

SERVED_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: ``theta`` and, for ``llama3`` (Llama 3.1+), its frequency scaling."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0  # llama3: low frequencies are divided by it
    low_freq_factor: float = 1.0  # llama3: wavelengths past original / low_freq_factor scale fully
    high_freq_factor: float = 4.0  # llama3: wavelengths under original / high_freq_factor do not
    original_max_positions: int = 0  # llama3: the pretraining context (tokens)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """``[head_dim / 2]`` inverse frequencies (float32, CPU)."""
        import torch

        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "default":
            return inv_freq
        # llama3 (transformers' _compute_llama3_parameters): wavelengths shorter than
        # high_freq_wavelen are kept, longer than low_freq_wavelen divided by factor, and those
        # between interpolated smoothly between the two
        low_freq_wavelen = self.original_max_positions / self.low_freq_factor
        high_freq_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)


def read_rope(config: dict) -> Rope:
    """The RoPE of an HF config.json: transformers 5 writes ``rope_parameters`` (theta inside),
    4.x ``rope_theta`` beside ``rope_scaling`` (which wins, as transformers reads it); a rope
    this module does not compute is refused."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        raise refuse(f"partial_rotary_factor {partial!r}", "it rotates the whole head, 1.0")
    if rope_type == "default":
        return Rope(theta)
    if rope_type != "llama3":
        raise refuse(f"rope_type {rope_type!r}", f"it computes {list(SERVED_TYPES)}")
    # transformers: a top-level original_max_position_embeddings wins, then the rope dict's,
    # then max_position_embeddings
    original = config.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", config.get("max_position_embeddings", 2048)
    )
    return Rope(
        theta,
        "llama3",
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(original),
    )
