"""``areal plot RUN_DIR``: what the run logged against step (PNG): reward and held-out accuracy
for RL, loss for SFT, pair accuracy for reward models, Core async PPO's version lag, buffer,
admission refusals and per-rollout-worker throughput, and time per stage."""

from __future__ import annotations

from pathlib import Path

from areal.utils.jsonl import read_records

TIMING_PREFIX = "timing/"
# (title, keys): a panel is drawn when the run logged one of its keys (RL, SFT and RM runs log
# different things), then seconds per stage.
PANELS = [
    ("mean reward (training rollouts)", ["reward/mean"]),
    ("held-out accuracy", ["eval/accuracy"]),
    ("loss", ["loss/loss", "eval/loss"]),
    ("pair accuracy (reward model)", ["loss/pair_acc", "eval/pair_acc"]),
    ("version lag of trained samples (Core async)", ["core/lag/max", "core/lag/mean"]),
    ("rollouts buffered / running (Core async)", ["manager/buffered", "manager/running"]),
    (
        "admission refusals, asks so far (Core async)",
        [f"manager/refused/{c}" for c in ("staleness", "capacity", "paused", "fair_share")],
    ),
]
WORKER_THROUGHPUT = ("rollout worker tokens/s (Core async)", "rollout_worker/", "/tokens_per_s")


def read_stats(run_dir: str | Path) -> list[dict]:
    """Rows of RUN_DIR/stats.jsonl; a clear error if the run wrote none."""
    path = Path(run_dir) / "stats.jsonl"
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(
            f"{run_dir}: no such run directory; pass RUN_DIR = fileroot/experiment_name/"
            "trial_name of a run (e.g. runs/quickstart/grpo/run)"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: is {run_dir} a run dir with stats_logger.jsonl=true?"
        )
    rows = read_records(path)  # a half-written last line (a running or killed run) is skipped
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step yet")
    return rows


def panels(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """The panels to draw for these rows: those of :data:`PANELS` the run logged, then stage
    times (``not logged`` when there are none)."""
    logged = {k for r in rows for k in r}
    chosen = [(title, keys) for title, keys in PANELS if logged & set(keys)]
    title, prefix, suffix = WORKER_THROUGHPUT
    per_worker = sorted(k for k in logged if k.startswith(prefix) and k.endswith(suffix))
    if per_worker:
        chosen.append((title, per_worker))
    return [
        *chosen,
        ("seconds per stage", sorted(k for k in logged if k.startswith(TIMING_PREFIX))),
    ]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw what RUN_DIR/stats.jsonl holds (:func:`panels`) into ``out`` (default
    RUN_DIR/plot.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_stats(run_dir)
    out = Path(out) if out else Path(run_dir) / "plot.png"
    chosen = panels(rows)
    fig, axes = plt.subplots(1, len(chosen), figsize=(5 * len(chosen), 4), squeeze=False)
    for ax, (title, keys) in zip(axes[0], chosen):
        _series(ax, rows, keys, title)
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
