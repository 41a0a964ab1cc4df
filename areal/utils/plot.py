"""``areal plot RUN_DIR``: reward, held-out accuracy and time per stage against step (PNG)."""

from __future__ import annotations

import json
from pathlib import Path

REWARD_KEY = "reward/mean"
EVAL_KEY = "eval/accuracy"
TIMING_PREFIX = "timing/"


def read_stats(run_dir: str | Path) -> list[dict]:
    """Rows of RUN_DIR/stats.jsonl; a clear error if the run wrote none."""
    path = Path(run_dir) / "stats.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run dir with stats_logger.jsonl=true?")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step yet")
    return rows


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the three panels from RUN_DIR/stats.jsonl into ``out`` (default RUN_DIR/plot.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_stats(run_dir)
    out = Path(out) if out else Path(run_dir) / "plot.png"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _series(axes[0], rows, [REWARD_KEY], "mean reward (training rollouts)")
    _series(axes[1], rows, [EVAL_KEY], "held-out accuracy")
    timing = sorted({k for r in rows for k in r if k.startswith(TIMING_PREFIX)})
    _series(axes[2], rows, timing, "seconds per stage")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _series(ax, rows: list[dict], keys: list[str], title: str) -> None:
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, label=key.removeprefix(TIMING_PREFIX))
    ax.set_title(title)
    ax.set_xlabel("step")
    if len(keys) > 1 and ax.lines:
        ax.legend(fontsize=7)
    if not ax.lines:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
