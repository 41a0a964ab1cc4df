"""How a request samples (:class:`SamplingParams`) and the logprob the server reports (the
batched sampler that draws the tokens is sampler.py); prompt logprobs; and
:func:`sample_continuations`, offline sampling from a Hugging Face model with its KV cache (the
sampler of ``areal dpo-pairs``).

Logprob definition (the contract with the trainer): for each sampled token ``x`` the server
reports ``log_softmax(logits / T)[x]`` where ``logits`` are the model's raw fp32 logits and ``T``
is the request's temperature (``T = 1`` for greedy requests, i.e. ``temperature == 0``). It is
taken *before* top-k / top-p / min-p truncation and before min-new-tokens suppression of stop
tokens, so a trainer reproduces it from a plain forward pass and the temperature alone. With the
default ``temperature=1`` it equals ``log_softmax`` of the raw logits. (Under a grammar the
logits are the masked ones: docs/serving.md, "Structured outputs".)

Reproducibility: a request with a ``seed`` draws counter-based noise from its seed and its
output position (sampler.py); its tokens depend only on its logits and its seed, not on which
other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal.api.sampling import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS  # serving.* import it here
from areal.api.sampling import sampling_problems

IMPOSSIBLE_LOGPROB = -9999.0  # a top_logprobs entry's floor (OpenAI's value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (SGLang ``sampling_params`` names)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # stop tokens are suppressed and stop strings ignored before this
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = no top-k
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 = off
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # in addition to EOS
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (need a tokenizer)
    ignore_eos: bool = False  # EOS does not stop (stop_token_ids still do)
    seed: int | None = None
    top_logprobs: int = 0  # also report this many most likely tokens per output position

    @property
    def greedy(self) -> bool:
        """Greedy when temperature is 0 or only the top token is allowed."""
        return self.temperature == 0.0 or self.top_k == 1

    def problems(self) -> list[str]:
        """``"field: message"`` for each invalid value (empty when valid): the shared rules of
        areal.api.sampling, which the agent client checks too."""
        problems = [
            f"{name}: {problem}"
            for name, problem in sampling_problems(
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.min_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                top_logprobs=self.top_logprobs,
            )
        ]
        if not 0 <= self.min_p <= 1:  # NaN fails too
            problems.append(f"min_p: must be in [0, 1], got {self.min_p}")
        return problems


def top_logprobs(
    logits: torch.Tensor, temperatures: list[float], ks: list[int]
) -> list[list[tuple[int, float]]]:
    """The ``ks[i]`` most likely ``(token, logprob)`` of row ``i`` under the reported
    distribution ``log_softmax(logits / T)`` (``T = 1`` for greedy rows: pass 1.0)."""
    logp = torch.log_softmax(
        logits.float() / torch.tensor(temperatures, device=logits.device)[:, None], dim=-1
    )
    top = logp.topk(max(ks), dim=-1)
    # A token a grammar masked has logprob -inf, which JSON cannot hold (json.dumps writes
    # -Infinity): reported as OpenAI reports impossible tokens, -9999.0.
    values = top.values.clamp(min=IMPOSSIBLE_LOGPROB)
    return [
        list(zip(ids[:k].tolist(), lps[:k].tolist()))
        for ids, lps, k in zip(top.indices, values, ks)
    ]


def prompt_logprobs(
    logits: torch.Tensor, input_ids: list[int], top: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """From a prompt's logits [P, V]: the logprob of each prompt token given the ones before it
    (the first has none: None) and, with ``top``, each position's ``top`` most likely tokens
    (temperature 1)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [P-1, V]
    targets = torch.tensor(input_ids[1:], device=logp.device)[:, None]
    chosen: list[float] = logp.gather(1, targets)[:, 0].tolist()
    n = len(input_ids) - 1
    tops = top_logprobs(logits[:-1], [1.0] * n, [top] * n) if top and n else [[] for _ in range(n)]
    return [None, *chosen], [None, *tops]


@torch.no_grad()
def sample_continuations(
    model: torch.nn.Module,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_new_tokens: int,
    eos: int,
    pad: int,
) -> list[list[int]]:
    """``n`` sampled continuations per prompt from a Hugging Face causal LM (offline data
    generation: ``areal dpo-pairs``), without the end token ``eos``, prompt-major. Plain
    temperature sampling: the distribution the server samples from with default knobs.

    Each prompt is prefilled once and its KV cache repeated ``n`` times (``generate``'s
    ``num_return_sequences`` would prefill every copy); left padding, positions from the mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
    )
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # [B*n, V]
    mask = mask.repeat_interleave(n, 0)  # [B*n, P]
    tokens, done = [], torch.zeros(len(mask), dtype=torch.bool)
    for _ in range(max_new_tokens):
        tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1)[:, 0]  # [B*n]
        tok = torch.where(done, torch.full_like(tok, eos), tok)
        tokens.append(tok)
        done |= tok == eos
        if bool(done.all()):
            break
        positions = mask.sum(-1, keepdim=True)  # [B*n, 1] next position of each row
        mask = torch.cat([mask, torch.ones_like(positions)], -1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
    rows = torch.stack(tokens, 1).tolist()  # [B*n, <= max_new_tokens]
    return [row[: row.index(eos)] if eos in row else row for row in rows]
