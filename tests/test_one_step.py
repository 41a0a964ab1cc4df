"""House rule as a test: a training step is written once, as a graph (areal/runtime/graphs.py),
and run by one runner (areal/runtime/step.py): Lite's scripts, ``areal replay`` and Core's
master all run the graph; none of them calls the step's model functions by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pyast

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("areal/**/*.py"), *ROOT.glob("examples/**/*.py")])
# The step's model functions (areal.api.mfc.ModelFn): only the runner calls them, by name.
STEP_FNS = {
    "compute_values",
    "compute_advantages",
    "ppo_update",
    "train_lm",
    "train_rw",
    "train_dpo",
}
# After each update the runner steps the engine's LR schedule (call_mfc).
LR_STEP = "step_lr_scheduler"


def _method_calls(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """``file:line .name(`` of every ``x.name(...)`` call in ``path`` with ``name`` in
    ``names`` (``file`` relative to ``root``)."""
    tree = pyast.parse(path.read_text(), str(path))
    rel = path.relative_to(root)
    return [
        f"{rel}:{node.lineno} .{node.func.attr}("
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
    ]


def test_the_steps_model_functions_are_called_only_by_the_runner():
    found = [call for path in SOURCES for call in _method_calls(path, STEP_FNS)]
    assert not found, (
        "the training step is the graph in areal/runtime/graphs.py, run by run_step (in "
        "process) or Core's master; call it instead of the model functions:\n" + "\n".join(found)
    )


def test_only_the_runner_steps_learning_rate_schedules():
    runner = ROOT / "areal" / "runtime" / "step.py"
    found = [call for path in SOURCES if path != runner for call in _method_calls(path, {LR_STEP})]
    assert not found, "an update's LR step belongs to call_mfc (areal/runtime/step.py):\n" + (
        "\n".join(found)
    )
    assert _method_calls(runner, {LR_STEP}), "the runner no longer steps LR schedules"


def test_the_guard_sees_a_hand_written_step(tmp_path):
    script = tmp_path / "step.py"
    script.write_text("def train_step(actor, batch):\n    return actor.ppo_update(batch)\n")
    assert _method_calls(script, STEP_FNS, tmp_path) == ["step.py:2 .ppo_update("]
