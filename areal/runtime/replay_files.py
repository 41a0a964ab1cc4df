"""The files of a replay record (``RUN_DIR/replay``, :mod:`areal.runtime.replay`), written and
read safely.

A replay reads a run dir that may come from someone else, so reading it must never run that
run's code: a step file holds tensors and one JSON string only and is read with
``torch.load(weights_only=True)`` (no object of the recorded run is unpickled); the entry script
runs only when the user names it (``--script PATH``) or trusts the run dir's own recorded copy
(``--trust-run-dir``: ``RUN_DIR/replay/script.py``), see :func:`replay_script`. A missing,
damaged or foreign file is a one-line :class:`ReplayFileError` naming the file and what is
wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal.utils.batch import PackedBatch
from areal.utils.jsonl import read_records

REPLAY_DIR = "replay"
META = "meta.json"
HASHES = "hashes.jsonl"
SCRIPT_COPY = "script.py"  # the recorded copy of the entry script, in RUN_DIR/replay
STEP_FORMAT = "areal-replay-step/2"  # tensors + one JSON string; 1 was a pickle with numpy arrays
META_KEYS = {"world_size": int, "torch": str, "threads": int}  # what a replay reads of meta.json
RERECORD = "re-record the run with stats_logger.replay.enabled=true"


class ReplayFileError(ValueError):
    """A replay record file that is missing, damaged or of another format (names the file)."""


class ReplayRefused(ValueError):
    """``areal replay`` was not told which script it may run (see :func:`replay_script`)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_meta(
    root: Path, script: str | Path | None, world_size: int, threads: int, one_rank: str = ""
) -> None:
    """``root/meta.json`` and a copy of ``script`` (the module ``areal replay`` runs) as
    ``root/script.py``; ``one_rank``: how to record a run of one rank (Core's)."""
    meta: dict[str, Any] = {
        "script": None,
        "world_size": world_size,
        "torch": torch.__version__,
        "threads": threads,
    }
    if script is not None and Path(script).is_file():  # not an interactive session's <stdin>
        source = Path(script).resolve()
        shutil.copyfile(source, root / SCRIPT_COPY)
        meta.update(script=str(source), script_sha256=_sha256(root / SCRIPT_COPY))
    if one_rank:
        meta["one_rank"] = one_rank
    (root / META).write_text(json.dumps(meta, indent=1) + "\n")


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/replay/meta.json; :class:`ReplayFileError` when it is missing or damaged."""
    path = Path(run_dir) / REPLAY_DIR / META
    if not Path(run_dir).is_dir():  # a typo, not a run that skipped recording
        raise ReplayFileError(
            f"{run_dir}: no such run directory; pass RUN_DIR = fileroot/experiment_name/"
            "trial_name of a run recorded with stats_logger.replay.enabled=true"
        )
    if not path.is_file():
        raise ReplayFileError(
            f"{path} is missing: {run_dir} was not recorded for replay; run it with "
            "stats_logger.replay.enabled=true"
        )
    try:
        meta = json.loads(path.read_text(errors="replace"))
    except ValueError as e:
        raise ReplayFileError(
            f"{path} is not valid JSON ({e}): cut short or damaged; {RERECORD}"
        ) from None
    if not isinstance(meta, dict):
        raise ReplayFileError(f"{path} holds a {type(meta).__name__}, not an object; {RERECORD}")
    wrong = [k for k, t in META_KEYS.items() if not isinstance(meta.get(k), t)]
    if wrong:
        raise ReplayFileError(
            f"{path} lacks {', '.join(wrong)} (or holds the wrong type): damaged; {RERECORD}"
        )
    return meta


def replay_script(
    run_dir: str | Path, meta: dict[str, Any], script: str | None, trust: bool
) -> Path:
    """The entry script a replay may run: ``script`` (``--script PATH``, the user's choice), or
    with ``trust`` (``--trust-run-dir``) the run dir's recorded copy; otherwise
    :class:`ReplayRefused`, since replaying runs that Python code."""
    root = Path(run_dir) / REPLAY_DIR
    if script is not None:
        if not Path(script).is_file():
            raise ReplayFileError(
                f"--script {script}: no such file; pass the entry script that trained the run "
                "(e.g. examples/gsm8k_grpo.py)"
            )
        return Path(script)
    if not trust:
        raise ReplayRefused(
            f"{run_dir} was recorded by {meta.get('script') or 'an unnamed script'} and a replay "
            "runs that Python code; pass --trust-run-dir to run the run dir's own copy "
            f"({root / SCRIPT_COPY}), or --script PATH to run a script you trust "
            "(e.g. examples/gsm8k_grpo.py)"
        )
    copy = root / SCRIPT_COPY
    if not copy.is_file():
        raise ReplayFileError(
            f"{copy} is missing: {run_dir} holds no recorded copy of its script (recorded by an "
            "older areal, or by no script file); pass --script PATH (e.g. examples/gsm8k_grpo.py)"
        )
    if meta.get("script_sha256") not in (None, _sha256(copy)):
        raise ReplayFileError(
            f"{copy} changed after the run recorded it (its sha256 differs from {META}'s); "
            "pass --script PATH to run a script you trust"
        )
    return copy


# -------------------------------------------------------------------------------- step files


def pack_step(step: int, version: int, rng: dict[str, Any], batch: PackedBatch) -> dict[str, Any]:
    """One step's record as :data:`STEP_FORMAT`: ``{"format", "meta": JSON string, "tensors"}``
    (copies of ``batch``'s fields and the torch / NumPy RNG states; the rest in ``meta``)."""
    py_version, py_state, py_gauss = rng["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    tensors = {
        "cu_seqlens": batch.cu_seqlens.detach().cpu().clone(),
        "rng.torch": rng["torch"].clone(),
        "rng.numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),  # uint32 keys
        **{f"tokens.{k}": v.detach().cpu().clone() for k, v in batch.tokens.items()},
        **{f"seqs.{k}": v.detach().cpu().clone() for k, v in batch.seqs.items()},
    }
    meta = {
        "step": step,
        "version": version,
        "python_rng": [py_version, list(py_state), py_gauss],
        "numpy_rng": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "tokens": list(batch.tokens),
        "seqs": list(batch.seqs),
    }
    return {"format": STEP_FORMAT, "meta": json.dumps(meta), "tensors": tensors}


def save_step(record: dict[str, Any], path: Path) -> None:
    """Write :func:`pack_step`'s record to ``path`` atomically."""
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    os.replace(tmp, path)


def load_step_file(path: Path) -> tuple[PackedBatch, dict[str, Any]]:
    """The batch and record (``step``, ``version``, ``rng`` as ``rng_state`` gives it) of a step
    file; :class:`ReplayFileError` naming the file when it is not a sound :data:`STEP_FORMAT`."""
    try:  # weights_only: tensors and plain containers only, never an object of the run
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's errors name no file and span many lines
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise ReplayFileError(
            f"{path} is not a readable replay step file ({type(e).__name__}: {why}): cut short, "
            f"damaged, or recorded by an older areal; {RERECORD}"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != STEP_FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ReplayFileError(
            f"{path} is not a {STEP_FORMAT} step file (found {found!r}); {RERECORD}"
        )
    return _unpack(path, obj)


def _unpack(path: Path, obj: dict[str, Any]) -> tuple[PackedBatch, dict[str, Any]]:
    try:
        meta = json.loads(obj["meta"])
        tensors: dict[str, torch.Tensor] = obj["tensors"]
        names = [f"tokens.{k}" for k in meta["tokens"]] + [f"seqs.{k}" for k in meta["seqs"]]
        python_rng, numpy_rng = meta["python_rng"], meta["numpy_rng"]
        step, version = int(meta["step"]), int(meta["version"])
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayFileError(
            f"{path}: its meta is damaged ({type(e).__name__}: {e}); {RERECORD}"
        ) from None
    missing = [k for k in ("cu_seqlens", "rng.torch", "rng.numpy", *names) if k not in tensors]
    if missing:
        raise ReplayFileError(f"{path}: tensor(s) {missing} are missing; damaged, {RERECORD}")
    cu = tensors["cu_seqlens"]
    n_tokens, n_seqs = int(cu[-1]) if len(cu) else 0, len(cu) - 1
    wrong = [
        f"{k} has {len(tensors[k])} rows"
        for k in names
        if len(tensors[k]) != (n_tokens if k.startswith("tokens.") else n_seqs)
    ]
    if wrong:
        raise ReplayFileError(
            f"{path}: {'; '.join(wrong)}, but cu_seqlens says {n_tokens} tokens in {n_seqs} "
            f"sequences; damaged, {RERECORD}"
        )
    batch = PackedBatch(
        cu,
        {k: tensors[f"tokens.{k}"] for k in meta["tokens"]},
        {k: tensors[f"seqs.{k}"] for k in meta["seqs"]},
    )
    np_name, np_pos, np_has_gauss, np_gauss = numpy_rng
    rng = {
        "python": (python_rng[0], tuple(python_rng[1]), python_rng[2]),
        "numpy": (
            np_name,
            tensors["rng.numpy"].numpy().astype(np.uint32),
            np_pos,
            np_has_gauss,
            np_gauss,
        ),
        "torch": tensors["rng.torch"],
    }
    return batch, {"step": step, "version": version, "rng": rng}


# -------------------------------------------------------------------------- hashes, weights


def recorded_hashes(root: Path) -> dict[int, dict[str, str]]:
    """``hashes.jsonl``: the tensor hashes of each recorded step (a half-written last line of a
    killed run is skipped with a warning); :class:`ReplayFileError` when a record is damaged
    or a step between 0 and the last is missing."""
    path = root / HASHES
    hashes: dict[int, dict[str, str]] = {}
    for rec in read_records(path):
        step, tensors = rec.get("step"), rec.get("tensors")
        if not isinstance(step, int) or not isinstance(tensors, dict):
            raise ReplayFileError(
                f"{path}: a line lacks an integer 'step' or a 'tensors' object: damaged; {RERECORD}"
            )
        hashes[step] = tensors
    gaps = sorted(set(range(max(hashes, default=-1) + 1)) - set(hashes))
    if gaps:
        raise ReplayFileError(
            f"{path}: the hashes of step(s) {gaps[:5]} are missing: damaged; replay up to step "
            f"{gaps[0] - 1} with --to, or {RERECORD}"
        )
    return hashes


def recorded_tensor(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a ``weights-<step>.pt`` file (weights only); :class:`ReplayFileError`
    naming the file when it is unreadable or lacks the tensor."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's errors name no file and span many lines
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise ReplayFileError(
            f"{path} is unreadable ({type(e).__name__}: {why}); delete it to replay without "
            "max |diff|, or re-record"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get(name), torch.Tensor):
        raise ReplayFileError(f"{path} holds no tensor {name!r}: damaged; delete it or re-record")
    return state[name]
