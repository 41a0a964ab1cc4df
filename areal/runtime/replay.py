"""Deterministic replay of an RL run's trainer: the recording (:class:`ReplayRecorder`) and
the replay itself (:func:`replay_run`, ``areal replay RUN_DIR``; docs/viewer.md, "Replay"). Lite
runs record here; Core async PPO runs through :mod:`areal.core.record` (the same files, with
:mod:`areal.core.replay` as the script the replay loads).

With ``stats_logger.replay.enabled`` each trainer rank writes to ``RUN_DIR/replay``:

- ``meta.json`` (rank 0): the entry script, trainer ranks, torch version, intra-op threads;
- ``script.py`` (rank 0): a copy of that entry script, the code ``areal replay
  --trust-run-dir`` runs (a replay never runs a script unless told to:
  :func:`~areal.runtime.replay_files.replay_script`);
- ``step-<step:06d>-rank<r>.pt``: the packed batch the actor trains on at that step, exactly as
  ``groups_to_batch`` built it (``cu_seqlens`` and every token and sequence field, in order), the
  Python / NumPy / torch RNG states just before the train step and the actor's weight version:
  tensors and one JSON string only (:func:`pack_step`), read with ``torch.load(weights_only=True)``
  so a replay never unpickles an object of the recorded run;
- ``hashes.jsonl`` (rank 0): one line per step, a blake2b hash of every actor tensor (full, HF
  names) after the step; step 0 is the initial weights;
- ``weights-<step:06d>.pt`` (rank 0, ``keep_weights``): the actor's full weights after the step,
  so a replay can name the max difference of a differing tensor.

A damaged file (a truncated ``meta.json``, a cut-short or foreign step file, a missing tensor) is
a one-line :class:`ReplayFileError` naming the file and what is wrong.

Recording turns on ``torch.use_deterministic_algorithms``. The replay re-runs only the trainer, in
one process, from the initial weights (``setup_trainers`` of the entry script) on the recorded
batches through the script's own ``train_step``, restoring each step's RNG states first, and
compares the hashes step by step. Bit-identical needs the same torch build and the same
intra-op thread count (the replay sets the recorded one) on the same kind of CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from areal.runtime.replay_files import (
    HASHES,
    REPLAY_DIR,
    ReplayFileError,
    load_step_file,
    pack_step,
    read_meta,
    recorded_hashes,
    recorded_tensor,
    save_step,
    write_meta,
)
from areal.utils.batch import PackedBatch
from areal.utils.jsonl import keep_steps_upto
from areal.utils.logging import get_logger
from areal.utils.recover import move_aside

if TYPE_CHECKING:
    from areal.api.config.base import ReplayConfig

logger = get_logger("replay")
BATCH_SECTIONS = ("gconfig", "train_dataset", "rollout", "cluster")  # what made the batches
ONE_RANK = "record with cluster.trainer_nprocs=1"  # how a Lite run trains its actor on one rank


def tensor_hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """blake2b (16 bytes, hex) of each tensor's dtype, shape and raw bytes, in ``state``'s order."""
    out = {}
    for name, t in state.items():
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def make_deterministic() -> None:
    """The settings a bit-identical replay needs on the recording and the replaying side."""
    torch.use_deterministic_algorithms(True)


def _step_path(root: Path, step: int, rank: int) -> Path:
    return root / f"step-{step:06d}-rank{rank}.pt"


class HashedActor(Protocol):
    """What a replay record reads of the actor (Lite's FSDPEngine, Core's RayModel)."""

    def get_version(self) -> int:
        """Version of the current weights."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, full, on the mesh's first rank ({} elsewhere). Collective."""
        ...


class ReplayRecorder:
    """Writes this rank's trainer inputs and (rank 0) the actor's weight hashes of every step."""

    def __init__(
        self, cfg: ReplayConfig, run_dir: str | Path, rank: int, world_size: int, fresh: bool = True
    ):
        """``fresh``: a new run of the trial; an earlier run's replay dir is moved aside."""
        self.cfg = cfg
        self.root = Path(run_dir) / REPLAY_DIR
        self.rank = rank
        if not cfg.enabled:
            return
        make_deterministic()
        if fresh and rank == 0 and self.root.is_dir() and any(self.root.iterdir()):
            moved = move_aside(self.root)
            logger.warning(
                f"{self.root} held the replay record of an earlier run of this trial; moved to "
                f"{moved}"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            write_meta(self.root, main, world_size, torch.get_num_threads())

    @contextlib.contextmanager
    def step(self, step: int, batch: PackedBatch, actor: HashedActor) -> Iterator[None]:
        """Around one train step: record ``batch`` (as ``groups_to_batch`` built it), the RNG
        states and ``actor``'s version before it, the weight hashes after it (collective)."""
        if not self.cfg.enabled:
            yield
            return
        from areal.runtime.run import rng_state

        if step == 1:
            self._hash_weights(0, actor)  # the initial weights a replay starts from
        record = pack_step(step, actor.get_version(), rng_state(), batch)  # copies, before the step
        yield
        save_step(record, _step_path(self.root, step, self.rank))
        self._hash_weights(step, actor)

    def describe(self, script: str | Path, world_size: int, threads: int, one_rank: str) -> None:
        """Rewrite meta.json for a trainer that is not this process (Core: the model workers):
        the module ``areal replay`` loads (``CONFIG``, ``setup_trainers``, ``train_step``), the
        actor's ranks, their intra-op threads and how to record a run of one rank."""
        if self.cfg.enabled and self.rank == 0:
            write_meta(self.root, script, world_size, threads, one_rank)

    def _hash_weights(self, step: int, actor: HashedActor) -> None:
        state = actor.full_state_dict()  # collective; {} off the mesh's first rank
        if self.rank != 0:
            return
        with open(self.root / HASHES, "a") as f:
            f.write(json.dumps({"step": step, "tensors": tensor_hashes(state)}) + "\n")
        if self.cfg.keep_weights:
            save_step(state, self.root / f"weights-{step:06d}.pt")

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a resume trains and records them again)."""
        if not self.cfg.enabled:
            return
        for path in self.root.glob(f"*-rank{self.rank}.pt"):
            if int(path.name.split("-")[1]) > step:
                path.unlink()
        if self.rank == 0:
            keep_steps_upto(self.root / HASHES, step)  # drops a killed run's half-written line
            for path in self.root.glob("weights-*.pt"):
                if int(path.stem.split("-")[1]) > step:
                    path.unlink()


# ------------------------------------------------------------------------------------ replay


@dataclass
class StepCheck:
    """One replayed step against the record: equal, or the first differing tensor."""

    step: int
    equal: bool
    n_differing: int = 0  # tensors whose hash differs
    tensor: str = ""  # the first of them, in state-dict order
    max_diff: float | None = None  # max |replayed - recorded| of that tensor (needs keep_weights)

    def line(self) -> str:
        """One human line for the report."""
        if self.equal:
            return f"step {self.step}: weights bit-identical"
        diff = (
            f"max |diff| {self.max_diff:.3g}"
            if self.max_diff is not None
            else "max |diff| unknown (record with stats_logger.replay.keep_weights=true to get it)"
        )
        return f"step {self.step}: {self.n_differing} tensors differ, first {self.tensor!r}, {diff}"


@dataclass
class ReplayReport:
    """What :func:`replay_run` found: one check per replayed step, the knobs the replay changed."""

    steps: list[StepCheck]
    knobs: list[str]
    notes: list[str] = field(
        default_factory=list
    )  # environment differences that break bit-identity

    @property
    def first_diff(self) -> StepCheck | None:
        """The first step whose weights differ from the record, or None."""
        return next((s for s in self.steps if not s.equal), None)

    @property
    def ok(self) -> bool:
        """A plain replay must match bit for bit; a changed-knob replay's divergence is
        information."""
        return self.first_diff is None or bool(self.knobs)

    def text(self) -> str:
        """The report ``areal replay`` prints."""
        lines = [*self.notes, *(s.line() for s in self.steps)]
        first = self.first_diff
        if first is None:
            lines.append(
                f"replay matches the record bit for bit at every step (0..{self.steps[-1].step})"
            )
        elif self.knobs:
            lines.append(
                f"with {' '.join(self.knobs)} the weights first differ at step {first.step} "
                "(expected: a changed knob on the original samples; see docs/viewer.md, 'Replay')"
            )
        else:
            lines.append(
                f"MISMATCH: the replay first differs from the record at step {first.step}, "
                f"tensor {first.tensor!r}"
            )
        return "\n".join(lines)


def check_step(
    root: Path, step: int, recorded: dict[str, str], state: dict[str, torch.Tensor]
) -> StepCheck:
    """Compare ``state`` (the replay's actor after ``step``) with the recorded hashes of
    ``step``."""
    if list(recorded) != list(state):
        raise ValueError(
            f"step {step}: the replay's actor has tensors {sorted(set(state) ^ set(recorded))[:5]} "
            "that the record does not (or the reverse); replay with the recorded model "
            "(actor.path, actor.lora.*)"
        )
    now = tensor_hashes(state)
    differing = [k for k in recorded if recorded[k] != now[k]]
    if not differing:
        return StepCheck(step, True)
    weights = root / f"weights-{step:06d}.pt"
    max_diff = None
    if weights.is_file():
        before = recorded_tensor(weights, differing[0])
        max_diff = (state[differing[0]].double() - before.double()).abs().max().item()
    return StepCheck(step, False, len(differing), differing[0], max_diff)


def load_step(root: Path, step: int) -> tuple[PackedBatch, dict[str, Any]]:
    """The recorded batch of ``step`` (rank 0) and its record (RNG states, version)."""
    path = _step_path(root, step, 0)
    if not path.is_file():
        raise ReplayFileError(
            f"{path} is missing: step {step} was not recorded; replay fewer steps with --to"
        )
    batch, record = load_step_file(path)  # tensors + JSON only: no object of the run unpickled
    if record["step"] != step:
        raise ReplayFileError(
            f"{path} records step {record['step']}, not {step}: renamed or mixed up"
        )
    return batch, record


def replay_overrides(run_dir: Path) -> list[str]:
    """What a replay changes in the recorded config: its own run dir, and nothing recorded,
    published or resumed."""
    return [
        f"fileroot={json.dumps(str(run_dir))}",
        "experiment_name=replays",
        "trial_name=latest",
        "stats_logger.replay.enabled=false",
        "stats_logger.samples.enabled=false",
        "stats_logger.console=false",
        "stats_logger.tensorboard=false",
        "stats_logger.wandb=disabled",
        "recover.mode=disabled",
    ]


def _check_request(
    run_dir: Path,
    meta: dict[str, Any],
    hashes: dict[int, dict[str, str]],
    to: int | None,
    knobs: tuple,
) -> int:
    """The last recorded step; ValueError naming the fix for a replay that cannot run."""
    if meta["world_size"] != 1:
        raise ValueError(
            f"{run_dir} trained its actor on {meta['world_size']} ranks; areal replay re-runs one "
            f"process, so it replays runs of one rank ({meta.get('one_rank', ONE_RANK)})"
        )
    last = max(hashes, default=0)
    if last == 0:
        raise ReplayFileError(
            f"{run_dir / REPLAY_DIR / HASHES} records no trained step yet; replay after step 1 ends"
        )
    if to is not None and not 1 <= to <= last:
        raise ValueError(f"--to {to}: {run_dir} recorded steps 1..{last}; pass 1 <= --to <= {last}")
    fixed = [k for k in knobs if k.split("=", 1)[0].split(".", 1)[0] in BATCH_SECTIONS]
    if fixed:
        raise ValueError(
            f"{' '.join(fixed)}: a replay trains on the recorded batches, "
            f"so {'/'.join(BATCH_SECTIONS)} cannot change; change a trainer knob (actor.*, "
            "critic.*, ref.*)"
        )
    return last


def replay_run(
    run_dir: str | Path,
    config_class: type,
    setup_trainers: Callable,
    train_step: Callable,
    to: int | None = None,
    knobs: tuple[str, ...] = (),
) -> ReplayReport:
    """Re-run the trainer of ``run_dir`` on its recorded batches (see the module docstring);
    ``knobs`` are dotted overrides of the recorded config (a what-if replay)."""
    from areal.api.config import load_config
    from areal.runtime.run import init_run, set_rng_state

    run_dir = Path(run_dir)
    meta, root = read_meta(run_dir), run_dir / REPLAY_DIR
    hashes = recorded_hashes(root)
    last = _check_request(run_dir, meta, hashes, to, knobs)
    cfg = load_config(
        config_class, ["--config", str(run_dir / "config.yaml"), *replay_overrides(run_dir), *knobs]
    )
    notes = (
        []
        if meta["torch"] == torch.__version__
        else [
            f"note: recorded with torch {meta['torch']}, replayed with {torch.__version__}: "
            "bit-identity needs the same build"
        ]
    )
    make_deterministic()
    run = init_run(cfg, cfg.actor.path)
    torch.set_num_threads(meta["threads"])  # reductions split by thread count: the recorded one
    actor, critic, ref = setup_trainers(cfg, run, run.load_data().ft_spec)
    checks = [check_step(root, 0, hashes[0], actor.full_state_dict())]
    for step in range(1, (to or last) + 1):
        batch, record = load_step(root, step)
        for engine in (actor, critic):
            if engine is not None:
                engine.set_version(record["version"])
        set_rng_state(record["rng"])
        train_step(cfg, run, actor, critic, ref, batch)
        checks.append(check_step(root, step, hashes[step], actor.full_state_dict()))
        run.commit(step, to or last, run.tracker.export())
    for engine in (actor, critic, ref):
        if engine is not None:
            engine.destroy()
    run.close()
    return ReplayReport(checks, list(knobs), notes)
