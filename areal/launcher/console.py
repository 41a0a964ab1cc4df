"""The launcher's console: children's output, prefixed, with progress redraws as they happen.

A child's output is lines (``\\n``) and redraws (``\\r``: tqdm's bars). Lines are echoed as
``[name] text``. On a terminal a redraw replaces the console's last row at once (erased before
the next line and drawn again after it, so a bar stays below the log lines); elsewhere (a CI log,
a file) redraws are dropped and only the line that ends a bar is kept. :func:`split_output`
cuts a child's bytes into both kinds.
"""

from __future__ import annotations

import shutil
import sys
import threading
from typing import IO

ERASE_LINE = "\r\x1b[K"  # carriage return, then clear to the end of the row


def split_output(pending: bytes) -> tuple[list[tuple[str, bytes]], bytes]:
    """Cut ``pending`` (a child's output read so far) into ``("line", text)`` items, each ending at
    ``\\n`` (the text after its last ``\\r``: what a terminal would show), and ``("redraw",
    text)`` items: the newest frame, the text after the last non-empty ``\\r`` (tqdm writes a
    frame in one go, so a read ends with whole frames). Returns the items and the bytes left for
    the next read (a line not ended yet)."""
    items: list[tuple[str, bytes]] = []
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        items.append(("line", line.rstrip(b"\r").rsplit(b"\r", 1)[-1]))  # rstrip: CRLF line ends
    if b"\r" in pending:
        frames = [f for f in pending.split(b"\r") if f]
        if frames:
            items.append(("redraw", frames[-1]))  # the earlier ones are already overdrawn
        pending = b"\r" + pending.rsplit(b"\r", 1)[1]  # a frame may go on in the next read
    return items, pending


class Console:
    """Writes every child's echo to ``out`` under one lock (shared by a supervisor's pumps)."""

    def __init__(self, out: IO[str] | None = None, tty: bool | None = None):
        self.out = out if out is not None else sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._bar = ""  # the redraw now on the console's last row ('' none)
        self.broken = (
            False  # the console is gone (a write failed) or muted (teardown): nothing more
        )

    def line(self, prefix: str, text: str) -> None:
        """Echo one line; a bar of this child that the line ends is gone, another one is redrawn."""
        with self._lock:
            erase = ERASE_LINE if self._bar else ""
            if self._bar.startswith(f"[{prefix}] "):
                self._bar = ""
            self._write(f"{erase}[{prefix}] {text}\n{self._bar}")

    def redraw(self, prefix: str, text: str) -> None:
        """Show a progress frame on the last row (a terminal); dropped elsewhere."""
        if not self.tty:
            return
        width = shutil.get_terminal_size().columns - 1  # a wrapped row could not be redrawn
        with self._lock:
            self._bar = f"[{prefix}] {text}"[:width]
            self._write(ERASE_LINE + self._bar)

    def _write(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except OSError:  # the console is gone or full: the logs and memory still have it
            self.broken = True
