"""Metric sinks: console table, JSONL in the run dir, TensorBoard, and W&B when enabled.

Only rank 0 writes; other ranks' ``commit`` is a no-op (their numbers are already reduced into
rank 0's by ``StatsTracker.export``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.utils.jsonl import keep_steps_upto, repair_tail
from areal.utils.logging import get_logger
from areal.utils.recover import move_aside

if TYPE_CHECKING:  # type-only: utils sits below api
    from areal.api.config import StatsLoggerConfig

logger = get_logger("stats")


def format_table(step: int, stats: dict[str, float]) -> str:
    """Render metrics grouped by namespace as a plain-text table (rich, no colours)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step {step}", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in sorted(stats):
        v = stats[k]
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console = Console(width=100, record=True, force_terminal=False, color_system=None)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


class StatsLogger:
    """Writes each step's metrics to the sinks enabled in ``StatsLoggerConfig``."""

    def __init__(
        self,
        cfg: StatsLoggerConfig,
        run_dir: str | Path,
        rank: int = 0,
        config_dict: dict | None = None,
        fresh: bool = True,
    ):
        """``fresh``: a new run of the trial (not a resume): an earlier run's stats.jsonl is moved
        aside to stats.jsonl.<k>, so steps never restart inside one file."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._tb = self._wandb = None
        self._jsonl = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            path = self.run_dir / "stats.jsonl"
            if fresh and path.is_file() and path.stat().st_size:
                moved = move_aside(path)
                logger.warning(
                    f"{path} held the stats of an earlier run of this trial; moved to "
                    f"{moved} (a new trial_name keeps runs apart; recover.mode=resume "
                    "continues one)"
                )
            repair_tail(path)  # a killed run's half-written last line: appends stay valid JSONL
            self._jsonl = open(path, "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if cfg.wandb != "disabled":
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    f"stats_logger.wandb={cfg.wandb!r} but wandb is not installed; `pip install -e "
                    "'.[wandb]'` in the areal checkout, or set stats_logger.wandb=disabled"
                ) from None
            self._wandb = wandb.init(
                project=cfg.wandb_project, mode=cfg.wandb, dir=str(self.run_dir), config=config_dict
            )

    def commit(self, step: int, stats: dict[str, Any]) -> None:
        """Log one step's metrics to every enabled sink (rank 0 only)."""
        if self.rank != 0:
            return
        clean = {
            k: float(v)
            for k, v in stats.items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        }
        if self.cfg.console:
            logger.info("\n" + format_table(step, clean))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop the JSONL records of steps after ``step`` (a resume from the checkpoint of
        ``step`` logs them again), so the file's steps stay increasing. A line that is not a
        complete record (a killed run's half-written last line) is dropped with a warning."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        path = self.run_dir / "stats.jsonl"
        keep_steps_upto(path, step)
        self._jsonl = open(path, "a", buffering=1)

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
