"""Multi-turn RL: the model answers; if wrong, a feedback message is appended and it tries again.

Each of the ``n_samples`` episodes of a group runs up to ``max_turns`` turns. A turn is correct
when its reward reaches 1.0; the episode's reward is that turn's reward times
``turn_discount ** (turns used - 1)`` (when no turn is correct, the last turn's reward, discounted
the same way). The trajectory's completion interleaves the model's tokens (loss mask 1, their
behaviour logprobs and versions) with the injected tokens that close the assistant turn and add
the feedback plus the next assistant header (loss mask 0, logprob 0.0, version -1).

Injected tokens are the chat template's own rendering of the conversation after the model's
reply, so the model's tokens are never re-tokenized: the next request's input is exactly
``prompt + completion so far``. A truncated or aborted turn ends the episode (no retry).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse, Trajectory
from areal.api.workflow import RolloutWorkflow
from areal.dataset.chat import chat_text, encode
from areal.workflow.rlvr import (
    RolloutDumper,
    Scorer,
    group_version,
    item_prompt_ids,
    prompt_kwargs,
    reference_text,
    rollout_status,
)


def feedback_ids(
    tokenizer: Any, messages: list[dict], said_ids: list[int], feedback: str
) -> list[int]:
    """Tokens injected after the model's reply ``said_ids`` to ``messages``: the end of the
    assistant turn, the feedback user turn and the next assistant header."""
    head = chat_text(tokenizer, messages, add_generation_prompt=True)
    said = tokenizer.decode(said_ids)
    reply = tokenizer.decode(said_ids, skip_special_tokens=True)
    after = messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": feedback},
    ]
    full = chat_text(tokenizer, after, add_generation_prompt=True)
    if full.startswith(head + said):
        return encode(tokenizer, full[len(head + said) :])
    # The template renders the reply differently from how it was sampled (e.g. the reply
    # stopped on a stop string, not EOS): close the turn with EOS, then the template's own turn.
    eos = tokenizer.eos_token if not said.endswith(tokenizer.eos_token or "") else ""
    tail = chat_text(tokenizer, [{"role": "user", "content": feedback}], add_generation_prompt=True)
    return encode(tokenizer, eos + "\n" + tail)


@dataclasses.dataclass
class _Episode:
    """Token lists of one multi-turn episode as it grows."""

    completion_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    turn_starts: list[int] = dataclasses.field(default_factory=list)
    servers: list[str] = dataclasses.field(default_factory=list)

    def add_model(self, resp: ModelResponse) -> None:
        """Append the model's tokens (a turn): trained on, with their logprobs and versions."""
        self.turn_starts.append(len(self.completion_ids))
        self.servers += [s for s in resp.server.split(",") if s and s not in self.servers]
        self.completion_ids += resp.output_ids
        self.logprobs += resp.output_logprobs
        self.versions += resp.output_versions
        self.loss_mask += [1] * len(resp.output_ids)

    def add_injected(self, ids: list[int]) -> None:
        """Append injected tokens: loss mask 0, logprob 0.0, version -1."""
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)


class MultiTurnWorkflow(RolloutWorkflow):
    """Answer, get feedback when wrong, retry; see the module docstring."""

    def __init__(
        self,
        reward: Scorer,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        cfg: WorkflowConfig = WorkflowConfig(max_turns=2),
        dump_dir: str | Path | None = None,
    ):
        self.reward = reward
        self.gconfig = dataclasses.replace(gconfig, n_samples=1)
        self.n_samples = gconfig.n_samples
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.dumper = RolloutDumper(dump_dir) if cfg.dump_rollouts and dump_dir else None

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> list[Trajectory]:
        """Run ``n_samples`` multi-turn episodes concurrently and return them as a group."""
        group = await asyncio.gather(
            *(self._episode(engine, item, k) for k in range(self.n_samples))
        )
        if self.dumper is not None:
            self.dumper.dump(group, group_version(group, engine))
        return list(group)

    async def _episode(self, engine: InferenceEngine, item: dict[str, Any], k: int) -> Trajectory:
        if "messages" not in item:
            raise KeyError(
                f"item {item.get('id', '?')!r}: the multi-turn workflow needs 'messages' to "
                "render feedback turns; load RL data with areal.dataset.load_dataset"
            )
        prompt = item_prompt_ids(item, self.tokenizer)
        messages = list(item["messages"])
        sample_id = f"{item['id']}/{k}"
        ep = _Episode()
        texts: list[str] = []
        for turn in range(self.cfg.max_turns):
            req = ModelRequest(
                input_ids=prompt + ep.completion_ids,
                gconfig=self.gconfig,
                group_id=item["id"],
                metadata={"sample_id": sample_id, "turn": turn},
            )
            resp = await engine.agenerate(req)
            ep.add_model(resp)
            text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            texts.append(text)
            outcome = await self.reward.ascore(
                f"{sample_id}/turn{turn}",
                text,
                item["reference"],
                **prompt_kwargs(self.reward, self.tokenizer.decode(prompt)),
            )
            last_turn = turn == self.cfg.max_turns - 1
            if outcome.reward >= 1.0 or resp.stop_reason != "stop" or not outcome.ok or last_turn:
                break
            injected = feedback_ids(self.tokenizer, messages, resp.output_ids, self.cfg.feedback)
            ep.add_injected(injected)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": self.cfg.feedback},
            ]
        discount = self.cfg.turn_discount ** (len(texts) - 1)
        return Trajectory(
            prompt_ids=prompt,
            completion_ids=ep.completion_ids,
            logprobs=ep.logprobs,
            versions=ep.versions,
            loss_mask=ep.loss_mask,
            reward=outcome.reward * discount,
            status=rollout_status(resp, outcome),
            sample_id=sample_id,
            group_id=item["id"],
            prompt_text=self.tokenizer.decode(prompt),
            completion_text=self.tokenizer.decode(ep.completion_ids),
            reference=reference_text(item["reference"]),
            extras={"turns": float(len(texts))},
            server=",".join(ep.servers),
            turn_starts=ep.turn_starts,
        )
