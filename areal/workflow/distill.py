"""On-policy distillation's rollout side: any workflow's episode, then the teacher scores it.

The student samples as usual (so admission, the staleness bound and per-token versions hold);
each trajectory's completion is then scored by the teacher's servers (prompt logprobs of the
completion, one request per trajectory, all of a group at once) and carried as
``extras["teacher_logp"]``, a token field of the batch (``areal/algo/distill.py`` turns it into
advantages). Scoring has a deadline: a teacher that does not answer in time is an
infrastructure error and stops the run naming it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal.api.engine import InferenceEngine, TokenScorer
from areal.api.io import Trajectory
from areal.api.workflow import RolloutWorkflow

TEACHER_FIELD = "teacher_logp"


class TeacherScored(RolloutWorkflow):
    """``inner``'s episode with every completion scored by ``teacher`` within ``timeout`` s."""

    def __init__(self, inner: RolloutWorkflow, teacher: TokenScorer, timeout: float):
        self.inner, self.teacher, self.timeout = inner, teacher, timeout

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any]
    ) -> list[Trajectory] | None:
        group = await self.inner.arun_episode(engine, item)
        if group is None:
            return None
        calls = [
            self.teacher.ascore([*t.prompt_ids, *t.completion_ids], len(t.prompt_ids))
            for t in group
        ]
        try:
            scores = await asyncio.wait_for(asyncio.gather(*calls), self.timeout)
        except TimeoutError:
            raise RuntimeError(
                f"the teacher did not score a group of {len(group)} within distill.timeout="
                f"{self.timeout} s; check its servers' logs, or raise distill.timeout"
            ) from None
        for t, logp in zip(group, scores):
            t.extras[TEACHER_FIELD] = list(logp)
        return group
