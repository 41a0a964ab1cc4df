"""``workflow.type: reasoning_gym``: reasoning-gym's procedural tasks, one model turn each.

The items come from the dataset path ``reasoning_gym:TASK[:WEIGHT],...`` (areal.dataset.envs:
the question as the user message, the reasoning-gym entry as the reference). An episode asks the
model once and scores its answer with the task's own scorer
(``reasoning_gym.get_score_answer_fn(task)(answer, entry)``, in [0, 1]) under
``workflow.env_timeout``. The answer is the text inside the last ``<answer></answer>`` pair, or
the whole reply stripped when it has none (reasoning-gym's scorers give partial credit to a
reply that contains the right answer).
"""

from __future__ import annotations

from typing import Any

from areal.api.engine import InferenceEngine
from areal.api.io import Trajectory
from areal.workflow.envs.base import EnvWorkflow
from areal.workflow.rlvr import reference_text


def extract_answer(text: str) -> str:
    """The text of the last ``<answer>...</answer>`` in ``text``, else ``text`` stripped."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(text)
    return text.strip() if found is None else found


def score(task: str, answer: str, entry: dict[str, Any]) -> Any:
    """reasoning-gym's score of ``answer`` for ``entry`` of ``task`` (what the task returns)."""
    import reasoning_gym

    scorer = reasoning_gym.get_score_answer_fn(task)
    return scorer(answer, entry)  # pyright: ignore[reportCallIssue]  # annotated Callable[[], float]


class ReasoningGymWorkflow(EnvWorkflow):
    """One question, one answer, the task's scorer as the reward (see the module docstring)."""

    kind = "reasoning_gym"

    async def arun_episode(self, engine: InferenceEngine, item: dict) -> list[Trajectory] | None:
        """The agent workflow's group, each trajectory with the task's answer as its reference
        (what ``areal view`` shows beside the reply)."""
        group = await super().arun_episode(engine, item)
        for t in group or []:
            t.reference = reference_text(item["reference"]["answer"])
        return group

    async def episode(self, client: Any, item: dict) -> float:
        reference = item.get("reference")
        if not (isinstance(reference, dict) and "task" in reference and "entry" in reference):
            raise ValueError(
                f"item {item.get('id')!r} has no reasoning-gym reference; with "
                "workflow.type=reasoning_gym set train_dataset.path=reasoning_gym:TASK,..."
            )
        reply = await client.chat.completions.create(model="areal", messages=item["messages"])
        text = reply.choices[0].message.content or ""
        task = reference["task"]
        reward = await self.call_env(
            f"reasoning-gym scorer of {task}", score, task, extract_answer(text), reference["entry"]
        )
        return self.checked_reward(reward, f"reasoning-gym scorer of {task}")
