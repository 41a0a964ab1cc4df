"""The files through which the ``areal core`` commands talk to a running async-PPO job, read and
written without Ray or torch (so ``areal core status`` and ``scale`` start in a second):

- RUN_DIR/core_status.json: the master's state at its last step (:func:`write_status` each step
  of :mod:`areal.core.async_ppo`, :func:`mark_finished` at its end), shown by
  :func:`format_status`;
- RUN_DIR/core_scale.json: a scaling request (:func:`request_scale`), which the master takes
  before its next step (:func:`take_scale_request`, in
  :meth:`~areal.core.rollout_side.RayRolloutSide.rescale`);
- RUN_DIR/core_stop.json: a stop request (:func:`request_stop`): the master makes its next step
  the run's last (:func:`take_stop_request`, :meth:`areal.runtime.run.Run.end_at`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

SCALE_FILE = "core_scale.json"
STOP_FILE = "core_stop.json"
STATUS_FILE = "core_status.json"  # the master's state at its last step (areal core status)


class ScaleRequest(TypedDict):
    """A scaling request as RUN_DIR/core_scale.json holds it (:func:`request_scale`)."""

    rollout_workers: NotRequired[int]  # rollout workers wanted (absent: as many as now)
    add_servers: list[str]  # server addresses to start routing to
    remove_servers: list[str]  # server addresses to stop routing to


def _write_json(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON in one rename: readers see the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def write_status(run_dir: Path, step: int, n_steps: int, status: dict[str, Any]) -> None:
    """RUN_DIR/core_status.json: the live state ``areal core status RUN_DIR`` prints (``state``
    becomes ``finished`` at the end, :func:`mark_finished`; the master's pid tells a crashed
    run)."""
    _write_json(
        Path(run_dir) / STATUS_FILE,
        {
            "step": step,
            "total_steps": n_steps,
            "time": time.time(),
            "state": "running",
            "master_pid": os.getpid(),
            "master_host": socket.gethostname(),
            **status,
        },
    )


def mark_finished(run_dir: Path) -> None:
    """The run is over: RUN_DIR/core_status.json says so (``areal core status``, ``scale``); a
    stop request that came during the last step is dropped (a later resume must not take it)."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)
    path = Path(run_dir) / STATUS_FILE
    if path.is_file():
        _write_json(path, {**json.loads(path.read_text()), "state": "finished"})


def run_ended(status: dict) -> str:
    """Why the run of ``status`` (RUN_DIR/core_status.json) is over ('' while its master runs):
    it finished (before its last step: stopped by ``areal core stop``), or its master's process
    (on this host) is gone."""
    if status.get("state") == "finished":
        at = f"step {status['step']}/{status['total_steps']}"
        early = status["step"] < status["total_steps"]
        return f"it was stopped at {at} (areal core stop)" if early else f"it finished at {at}"
    pid, host = status.get("master_pid"), status.get("master_host")
    if pid and host == socket.gethostname() and not Path(f"/proc/{pid}").exists():
        return f"its master (pid {pid}) is gone, at step {status['step']}/{status['total_steps']}"
    return ""


def _require_running(run_dir: Path, what: str) -> None:
    """Refuse a request to a directory that is not a run, or to a run that has ended (nobody
    would take it), naming the fix."""
    if not (Path(run_dir) / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    status = Path(run_dir) / STATUS_FILE
    ended = run_ended(json.loads(status.read_text())) if status.is_file() else ""
    if ended:
        raise ValueError(
            f"{run_dir}: the run has ended ({ended}); `areal core {what}` applies to a running "
            f"`areal core async-ppo` job: launch it again (it resumes from its recover "
            f"checkpoint, if any) and {what} that"
        )


def request_scale(
    run_dir: Path, rollout_workers: int | None, add: list[str], remove: list[str]
) -> ScaleRequest:
    """Merge a scaling request into RUN_DIR/core_scale.json (the master takes it next step);
    refused for a run that has ended."""
    _require_running(run_dir, "scale")
    if rollout_workers is not None and rollout_workers < 1:
        raise ValueError(f"--rollout-workers {rollout_workers}: keep at least 1")
    path = Path(run_dir) / SCALE_FILE
    req: ScaleRequest = (
        json.loads(path.read_text())
        if path.is_file()
        else {"add_servers": [], "remove_servers": []}
    )
    if rollout_workers is not None:
        req["rollout_workers"] = rollout_workers
    req["add_servers"] += add
    req["remove_servers"] += remove
    _write_json(path, req)
    return req


def request_stop(run_dir: Path) -> None:
    """Ask the master to make its next step the run's last (RUN_DIR/core_stop.json): it saves
    and evaluates there as at ``total_train_steps``, writes a recover checkpoint when recovery
    is on, and ends; refused for a run that has ended."""
    _require_running(run_dir, "stop")
    _write_json(Path(run_dir) / STOP_FILE, {"time": time.time()})


def _take(path: Path) -> object:
    """The request a JSON file at ``path`` holds, removed from disk (None if there is none)."""
    if not path.is_file():
        return None
    req = json.loads(path.read_text())
    path.unlink()
    return req


def take_stop_request(run_dir: Path) -> bool:
    """Whether a stop was requested (the request is removed from disk)."""
    return _take(Path(run_dir) / STOP_FILE) is not None


def take_scale_request(run_dir: Path) -> ScaleRequest | None:
    """The pending scaling request, removed from disk (None if there is none)."""
    return cast(ScaleRequest | None, _take(Path(run_dir) / SCALE_FILE))  # request_scale wrote it


def format_status(run_dir) -> str:
    """``areal core status RUN_DIR``: the manager, the servers and every rollout worker at the
    last step (``*``: draining)."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: RUN_DIR must be an `areal core async-ppo` run "
            "that finished at least one step"
        )
    st = json.loads(path.read_text())
    m, ended = st["manager"], run_ended(st)
    refused = ", ".join(
        f"{k.rsplit('/', 1)[1]} {v:.0f}" for k, v in m.items() if k.startswith("manager/refused/")
    )
    when = f"step {st['step']}/{st['total_steps']}, {time.time() - st['time']:.0f} s ago"
    rollouts = (
        f"rollouts running {m['manager/running']:.0f}, buffered {m['manager/buffered']:.0f}"
        if not ended
        else f"rollouts in flight at its last step {m['manager/running']:.0f} (dropped at the "
        f"end), buffered {m['manager/buffered']:.0f}"
    )
    lines = [
        (f"run ended: {ended}, {time.time() - st['time']:.0f} s ago" if ended else when)
        + f"; version {m['manager/version']:.0f}; {rollouts}, lost {m['manager/lost']:.0f}; "
        f"refused asks: {refused}",
        f"model workers (pids): {st['model_worker_pids']}; servers: {st['servers']}"
        + (f"; refused servers: {st['servers_refused']}" if st["servers_refused"] else ""),
        f"{'worker':>6} {'pid':>8} {'episodes':>9} {'tok/s':>8} {'in_flight':>9} {'accepted':>9} "
        f"{'rejected':>9} {'failed':>7} {'restarts':>9}",
    ]
    for w in st["workers"]:
        c = {
            k: m.get(f"rollout_worker/{w['index']}/{k}", 0.0)
            for k in ("in_flight", "accepted", "rejected", "failed", "restarts")
        }
        name = f"{w['index']}{'*' if w['draining'] else ''}"
        lines.append(
            f"{name:>6} {w['pid']:>8} {w['episodes']:>9} {w['tokens_per_s']:>8.1f} "
            f"{c['in_flight']:>9.0f} {c['accepted']:>9.0f} {c['rejected']:>9.0f} "
            f"{c['failed']:>7.0f} {c['restarts']:>9.0f}"
        )
    return "\n".join(lines)
