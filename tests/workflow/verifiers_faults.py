"""verifiers tasksets whose scoring misbehaves, for tests/workflow/test_env_workflows.py: the
problems of examples/verifiers_tasks.py's sum_taskset, each with one faulty reward."""

from __future__ import annotations

import asyncio
import math

import verifiers.v1 as vf
from verifiers_tasks import ArithData, SumTask, SumTaskset


class RaisingTask(SumTask):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        raise RuntimeError("the rubric crashed")


class HangingTask(SumTask):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        await asyncio.sleep(5.0)  # past the test's env_timeout (0.2 s): cancelled
        return 1.0


class NaNTask(SumTask):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return math.nan


def _taskset(task_cls: type) -> SumTaskset:
    class Faulty(SumTaskset):
        def load(self):
            for task in super().load():
                yield task_cls(task.data)

    Faulty.task_type = classmethod(lambda cls: task_cls)  # type: ignore[method-assign]
    return Faulty(vf.TasksetConfig(id="faulty"), "train")


def raising() -> SumTaskset:
    return _taskset(RaisingTask)


def hanging() -> SumTaskset:
    return _taskset(HangingTask)


def nan() -> SumTaskset:
    return _taskset(NaNTask)
