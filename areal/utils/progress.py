"""A training run's step progress on the console: a redrawn bar on a terminal, plain lines in logs.

A trainer rank's output reaches the user through a launcher that echoes it line by line, so the
trainer cannot tell by itself whether a terminal is at the end. The launcher says so
(``AREAL_PROGRESS``, :class:`areal.api.launch.LaunchEnv`): ``bar`` is tqdm on stderr, whose
``\\r`` redraws the launcher's echo forwards as they come; ``lines`` is one plain line per
``every`` steps (about 20 a run) and at least one per ``interval`` seconds, e.g. for CI logs:
``steps 40/300 (13%) | 2.10 steps/s | ETA 2m04s | reward 0.42 | eval 0.31 | staleness 0.67``.
Both carry the run's headline figures (:data:`HEADLINE`, the latest value of each that the run
logged; held-out accuracy is logged at evaluation steps only), and :meth:`StepProgress.close`
prints one summary line at the end of every run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import IO

MODES = ("bar", "lines")
LINE_INTERVAL = 30.0  # seconds: a slow run still prints a line this often
# (label, stats key): what the progress line shows of a step's stats, when the run logs it (RL:
# training reward, held-out accuracy, staleness of trained tokens; SFT/RM/DPO: the loss)
HEADLINE = (
    ("reward", "reward/mean"),
    ("eval", "eval/accuracy"),
    ("staleness", "staleness/mean"),
    ("loss", "loss/loss"),
    ("eval loss", "eval/loss"),
)


def format_seconds(seconds: float) -> str:
    """``2m04s`` / ``1h02m`` / ``12s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class StepProgress:
    """Reports steps ``initial+1 .. total`` as they are done (``update()`` once per step)."""

    def __init__(
        self,
        total: int,
        initial: int,
        mode: str,
        out: IO[str] | None = None,
        interval: float = LINE_INTERVAL,
        desc: str = "steps",
        start: float | None = None,
    ):
        """``start``: time.monotonic() when step ``initial + 1`` began (default: now), so the
        first line's rate counts that step's time."""
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r} is not one of {list(MODES)}")
        self.total, self.step, self.mode, self.desc = total, initial, mode, desc
        self.out = out if out is not None else sys.stderr
        self.every = max(1, (total - initial) // 20)  # steps between two plain lines
        self.interval = interval  # seconds
        self._start = time.monotonic() if start is None else start
        self._initial = initial
        self.latest: dict[str, float] = {}  # label -> the last value logged (HEADLINE)
        self._last_line = self._start
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, dynamic_ncols=True, file=self.out
            )

    def update(self, stats: Mapping[str, float] | None = None) -> None:
        """One more step done, with its logged ``stats`` (the headline figures are kept)."""
        self.step += 1
        for label, key in HEADLINE:
            if stats is not None and key in stats:
                self.latest[label] = float(stats[key])
        if self._bar is not None:
            if self.latest:
                self._bar.set_postfix_str(self.figures(), refresh=False)
            self._bar.update(1)
            return
        now = time.monotonic()
        done = self.step - self._initial
        if (
            done == 1
            or self.step % self.every == 0
            or self.step >= self.total
            or now - self._last_line >= self.interval
        ):
            self._last_line = now
            print(self.line(now), file=self.out, flush=True)

    def line(self, now: float) -> str:
        """The plain progress line at time ``now`` (time.monotonic())."""
        done, elapsed = self.step - self._initial, max(now - self._start, 1e-9)
        rate = done / elapsed  # steps/s
        pct = 100 * self.step / self.total if self.total else 100.0
        eta = format_seconds((self.total - self.step) / rate) if rate > 0 else "?"
        line = f"{self.desc} {self.step}/{self.total} ({pct:.0f}%) | {rate:.2f} steps/s | ETA {eta}"
        return f"{line} | {self.figures()}" if self.latest else line

    def figures(self) -> str:
        """The headline figures: ``reward 0.42 | eval 0.31 | staleness 0.67``."""
        shown = [label for label, _ in HEADLINE if label in self.latest]
        return " | ".join(f"{label} {self.latest[label]:.4g}" for label in shown)

    def summary(self, now: float) -> str:
        """The end-of-run line: steps done, wall time, the last headline figures."""
        done = self.step - self._initial
        line = f"done: {done} {self.desc} in {format_seconds(now - self._start)}"
        return f"{line} | {self.figures()}" if self.latest else line

    def close(self) -> None:
        """End the bar (its last redraw becomes a plain line), then print the summary line."""
        if self._bar is not None:
            self._bar.close()
        if self.step > self._initial:
            print(self.summary(time.monotonic()), file=self.out, flush=True)
