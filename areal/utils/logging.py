"""Python logging with one format, plus a log file per process in the run directory."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname).1s [%(name)s] %(message)s"
DATEFMT = "%H:%M:%S"
_ROOT = "areal"


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``areal`` hierarchy (``areal.<name>``), console-configured once."""
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(f"{_ROOT}.{name}" if not name.startswith(_ROOT) else name)


def add_log_file(run_dir: str | Path, process_name: str) -> Path:
    """Also write every ``areal`` log record to ``RUN_DIR/logs/<process_name>.log``."""
    path = Path(run_dir) / "logs" / f"{process_name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger(_ROOT)
    get_logger("logging")  # make sure the console handler exists
    if not any(getattr(h, "baseFilename", None) == str(path.resolve()) for h in root.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        root.addHandler(handler)
    return path
