"""When to save / evaluate / checkpoint: every N epochs, N steps or N seconds (first that fires)."""

from __future__ import annotations

import time
from collections.abc import Callable


class FrequencyControl:
    """Decides, once per step, whether a periodic action is due. Pure apart from the clock.

    ``check(step, epoch_done)`` is called after each global step (``step`` counts from 1);
    ``epoch_done`` is True on the last step of an epoch. The seconds timer restarts when it fires.
    With ``last_step`` set (the run's last step: :meth:`areal.runtime.run.Run.steps` sets it for
    the saver and the evaluator), ``check`` is also True at that step, whatever the frequency,
    so a run always ends saved and evaluated; that extra firing restarts no timer.
    """

    def __init__(
        self,
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.freq_epochs, self.freq_steps, self.freq_secs = freq_epochs, freq_steps, freq_secs
        self.clock = clock
        self.epochs_done = 0
        self.last_fire = clock()
        self.last_step: int | None = None

    @classmethod
    def from_config(cls, cfg, clock: Callable[[], float] = time.monotonic) -> FrequencyControl:
        """Build from a ``TimerConfig``-shaped section (freq_epochs, freq_steps, freq_secs)."""
        return cls(cfg.freq_epochs, cfg.freq_steps, cfg.freq_secs, clock)

    def check(self, step: int, epoch_done: bool = False) -> bool:
        """True if the action is due after ``step``; records the firing."""
        if epoch_done:
            self.epochs_done += 1
        due = (
            (self.freq_steps is not None and step % self.freq_steps == 0)
            or (
                epoch_done
                and self.freq_epochs is not None
                and self.epochs_done % self.freq_epochs == 0
            )
            or (self.freq_secs is not None and self.clock() - self.last_fire >= self.freq_secs)
        )
        if due:
            self.last_fire = self.clock()
        return due or step == self.last_step

    def state_dict(self) -> dict:
        """Epoch count and seconds since the last firing (clock-independent)."""
        return {"epochs_done": self.epochs_done, "secs_since_fire": self.clock() - self.last_fire}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.epochs_done = state["epochs_done"]
        self.last_fire = self.clock() - state["secs_since_fire"]
