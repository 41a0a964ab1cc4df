"""Single-turn RL with verifiable rewards (RLVR): one prompt -> ``n_samples`` scored completions.

An episode renders the item's chat messages with the tokenizer's chat template (or takes its
``prompt_ids``), sends ``n_samples`` requests concurrently (one per sample, same ``group_id`` so
they share a server and its prefix cache), decodes each completion, scores it through the reward
runner (worker processes with a deadline), and returns the group as :class:`Trajectory` records.
Nothing is rejected here: filtering (e.g. all-equal rewards) is the trainer's choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any, Protocol

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import WorkflowConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse, RolloutStatus, Trajectory
from areal.api.workflow import RolloutWorkflow
from areal.dataset.chat import prompt_ids
from areal.reward.runner import RewardOutcome

_STATUS = {
    "stop": RolloutStatus.COMPLETED,
    "length": RolloutStatus.TRUNCATED,
    "abort": RolloutStatus.ABORTED,
}


class Scorer(Protocol):
    """What workflows need from a reward runner (``areal.reward.runner.RewardRunner`` is one)."""

    async def ascore(self, sample_id: str, completion: str, reference: Any) -> RewardOutcome:
        """Score one completion against the item's reference."""


def prompt_kwargs(reward: Scorer, prompt_text: str) -> dict[str, str]:
    """``{"prompt": text}`` for a reward function that takes the prompt, else ``{}``."""
    return {"prompt": prompt_text} if getattr(reward, "wants_prompt", False) else {}


def sample_seed(seed: int | None, prompt_id: Any, k: int, version: int) -> int | None:
    """Sample ``k`` of prompt ``prompt_id`` at weight ``version``: its own sampling seed
    (``gconfig.seed``; None keeps the server's shared generator)."""
    if seed is None:
        return None
    return seed + zlib.crc32(f"{prompt_id}/{k}/{version}".encode())


def reference_text(reference: Any) -> str:
    """An item's reference answer as the viewer shows it: a string as it is, else its JSON."""
    return reference if isinstance(reference, str) else json.dumps(reference, default=str)


def rollout_status(response: ModelResponse, reward: RewardOutcome) -> RolloutStatus:
    """Trajectory status: a failed reward call wins over the generation's stop reason."""
    if not reward.ok:
        return RolloutStatus.ERROR_REWARD
    return _STATUS[response.stop_reason]


def item_prompt_ids(item: dict[str, Any], tokenizer: Any) -> list[int]:
    """The item's ``prompt_ids``, or its ``messages`` through the chat template."""
    if "prompt_ids" in item:
        return list(item["prompt_ids"])
    if "messages" not in item:
        raise KeyError(
            f"item {item.get('id', '?')!r} has neither 'prompt_ids' nor 'messages' (keys: "
            f"{sorted(item)}); load RL data with areal.dataset.load_dataset"
        )
    return prompt_ids(tokenizer, item["messages"])


class RolloutDumper:
    """Appends one JSON line per trajectory to ``<dump_dir>/<version>.jsonl``."""

    def __init__(self, dump_dir: str | Path):
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)

    def dump(self, group: list[Trajectory], version: int) -> Path:
        """Write the group under weight version ``version``; returns the file written."""
        path = self.dump_dir / f"{version}.jsonl"
        with open(path, "a", encoding="utf-8") as f:
            for t in group:
                record = {
                    "sample_id": t.sample_id,
                    "version": version,
                    "prompt": t.prompt_text,
                    "completion": t.completion_text,
                    "reward": t.reward,
                    "status": t.status.value,
                    "n_tokens": len(t.completion_ids),
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return path


def group_version(group: list[Trajectory], engine: InferenceEngine) -> int:
    """The newest weight version that produced any token of the group (engine's if none)."""
    versions = [v for t in group for v in t.versions if v >= 0]
    return max(versions) if versions else engine.get_version()


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn episodes scored by a verifiable reward; see the module docstring."""

    def __init__(
        self,
        reward: Scorer,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        cfg: WorkflowConfig = WorkflowConfig(),
        dump_dir: str | Path | None = None,
        greedy_baseline: bool = False,
    ):
        self.reward = reward
        self.gconfig = dataclasses.replace(gconfig, n_samples=1)  # fan-out happens here
        self.n_samples = gconfig.n_samples
        self.tokenizer = tokenizer
        self.dumper = RolloutDumper(dump_dir) if cfg.dump_rollouts and dump_dir else None
        # ReMax: one extra greedy rollout per prompt; its reward is every sample's baseline
        self.greedy_baseline = greedy_baseline

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> list[Trajectory]:
        """Generate ``n_samples`` completions concurrently, score them, return the group."""
        ids = item_prompt_ids(item, self.tokenizer)
        version = engine.get_version()
        requests = [
            ModelRequest(
                input_ids=ids,
                gconfig=self.gconfig,
                group_id=item["id"],
                metadata={"sample_id": f"{item['id']}/{k}"},
                seed=sample_seed(self.gconfig.seed, item["id"], k, version),
            )
            for k in range(self.n_samples)
        ]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in responses]
        prompt_text = self.tokenizer.decode(ids)
        extra = prompt_kwargs(self.reward, prompt_text)
        outcomes = await asyncio.gather(
            *(
                self.reward.ascore(f"{item['id']}/{k}", text, item["reference"], **extra)
                for k, text in enumerate(texts)
            )
        )
        group = [
            Trajectory(
                prompt_ids=ids,
                completion_ids=list(resp.output_ids),
                logprobs=list(resp.output_logprobs),
                versions=list(resp.output_versions),
                loss_mask=[1] * len(resp.output_ids),
                reward=outcome.reward,
                status=rollout_status(resp, outcome),
                sample_id=f"{item['id']}/{k}",
                group_id=item["id"],
                prompt_text=prompt_text,
                completion_text=text,
                reference=reference_text(item["reference"]),
                server=resp.server,
            )
            for k, (resp, text, outcome) in enumerate(zip(responses, texts, outcomes))
        ]
        if self.greedy_baseline:
            baseline = await self._greedy_reward(engine, ids, item)
            for t in group:
                t.extras["baseline_rewards"] = baseline
        if self.dumper is not None:
            self.dumper.dump(group, group_version(group, engine))
        return group

    async def _greedy_reward(
        self, engine: InferenceEngine, ids: list[int], item: dict[str, Any]
    ) -> float:
        """Reward of the greedy completion of the prompt (ReMax's baseline; not trained on)."""
        greedy = dataclasses.replace(self.gconfig, greedy=True)
        resp = await engine.agenerate(
            ModelRequest(input_ids=ids, gconfig=greedy, group_id=item["id"])
        )
        text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        # a failed baseline reward scores 0 (and is counted by the runner like any other)
        extra = prompt_kwargs(self.reward, self.tokenizer.decode(ids))
        return (
            await self.reward.ascore(f"{item['id']}/greedy", text, item["reference"], **extra)
        ).reward
