"""Two verifiers (v1) tasksets for ``workflow.type: verifiers`` (examples/verifiers_grpo.yaml,
docs/environments.md), written with verifiers' own classes (``vf.Taskset``, ``vf.Task``,
``vf.TaskData``, ``vf.Toolset``, ``@vf.reward``, ``@vf.tool``):

* :func:`sum_taskset`: single turn, "a + b"; reward 1.0 when the reply is the sum.
* :func:`calc_taskset`: multi-turn with a tool, "a * b" with a ``multiply`` tool the model may
  call before it answers; reward 1.0 when the last reply holds the product.

Each function takes ``split`` (``train`` or another name: the held-out problems) and builds 200
problems from a seeded generator.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str = ""


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


class SumTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(_last_number(trace.last_reply) == task.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, split: str) -> None:
        super().__init__(config)
        self.split = split

    def load(self):
        rng = random.Random(f"sum/{self.split}")
        for k in range(200):
            a, b = rng.randrange(10), rng.randrange(10)
            yield SumTask(ArithData(id=f"sum{k}", prompt=f"{a} + {b} =", answer=str(a + b)))


class Calculator(vf.Toolset):
    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class CalcTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(_last_number(trace.last_reply) == task.answer)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def __init__(self, config: vf.TasksetConfig, split: str) -> None:
        super().__init__(config)
        self.split = split

    def load(self):
        rng = random.Random(f"calc/{self.split}")
        for k in range(200):
            a, b = rng.randrange(10, 100), rng.randrange(10, 100)
            prompt = f"What is {a} * {b}? You may call the multiply tool, then answer."
            yield CalcTask(ArithData(id=f"calc{k}", prompt=prompt, answer=str(a * b)))

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]


def sum_taskset(split: str = "train") -> SumTaskset:
    return SumTaskset(vf.TasksetConfig(id="sum"), split)


def calc_taskset(split: str = "train") -> CalcTaskset:
    return CalcTaskset(vf.TasksetConfig(id="calc"), split)
