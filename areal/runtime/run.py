"""The run context every entry script shares, so the scripts themselves read as the algorithm.

:func:`init_run` reads the launch env contract (:mod:`areal.api.launch`), initialises
``torch.distributed`` once (:mod:`areal.runtime.dist`), seeds, opens the per-process log file,
writes the resolved config and loads the tokenizer. The returned :class:`Run` holds the periodic
timers (saver / evaluator / recover), the stats tracker and sinks with a progress bar, and saves /
loads recover checkpoints: each engine's DCP checkpoint (model, optimizer, scheduler) plus one state
file per rank (counters, dataloader and executor state, timers, RNG states), published
atomically with a manifest and verified before a resume by :class:`~areal.utils.recover.RecoverDir`.

The step loop stays in the entry script; the run holds its rules. :meth:`Run.resume` is the
prologue: it registers what a recover checkpoint holds (the engines, and the
:class:`~areal.api.protocols.Checkpointable` parts and :class:`~areal.api.protocols.Publisher`
the script names), restores them from the newest usable checkpoint and returns the step to go on
from; :meth:`Run.checkpoint` saves them. :meth:`Run.steps` (and :meth:`Run.batches`) yield the
steps and tell the saver and the evaluator the last one, at which they always fire.
When a resume is pending, RUN_DIR/config.yaml is written only once it is accepted, so a refused
resume leaves the config of the run it refused to continue as it was.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as torch_dist

from areal.api.config import BaseExperimentConfig, ConfigError, save_config
from areal.api.io import FinetuneSpec, SaveLoadMeta
from areal.api.launch import LaunchEnv
from areal.api.protocols import Checkpointable, Persistent, Publisher
from areal.dataset import create_dataloader, load_dataset
from areal.runtime.dist import DistContext, close_distributed, init_distributed
from areal.runtime.preflight import preflight
from areal.runtime.replay import ReplayRecorder
from areal.runtime.samples import SampleRecorder
from areal.utils.jsonl import repair_tail
from areal.utils.logging import add_log_file, get_logger
from areal.utils.name_resolve import NameRepository, gen_servers_key, make_repository
from areal.utils.process import die_with
from areal.utils.progress import StepProgress
from areal.utils.recover import (
    Ranks,
    RecoverDir,
    RecoverError,
    load_state,
    resume_pending,
    save_state,
)
from areal.utils.stats import StatsTracker
from areal.utils.stats_logger import StatsLogger
from areal.utils.timers import FrequencyControl

logger = get_logger("run")


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of this process."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class Data:
    """This rank's training loader (and held-out loader), with the sizes schedules need."""

    loader: Any  # StatefulDataLoader over this rank's shard; its state resumes mid-epoch
    valid_loader: Any | None
    n_train: int  # items in the training set (all ranks)
    n_steps: int  # steps of the whole run
    ft_spec: FinetuneSpec


B = TypeVar("B", covariant=True)  # a loader's batch
T = TypeVar("T")  # what _all_gather gathers


class _Loader(Iterable[B], Sized, Protocol[B]):
    """A data loader: batches when iterated, ``len`` = batches per epoch."""


@dataclass
class _Saved:
    """What :meth:`Run.checkpoint` saves; :meth:`Run.resume` registers it."""

    engines: dict[str, Persistent]
    parts: dict[str, Checkpointable]  # by their key in the state file
    weights: Publisher | None  # its version is the state file's "version"


@dataclass
class Run:
    """One trainer process's view of the run (see the module docstring)."""

    cfg: BaseExperimentConfig
    dist: DistContext
    env: LaunchEnv
    tokenizer: Any
    tracker: StatsTracker = field(default_factory=StatsTracker)

    @property
    def rank(self) -> int:
        """This trainer rank."""
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """Trainer ranks of the job."""
        return self.dist.world_size

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.run_dir = cfg.run_dir
        self.saver = FrequencyControl.from_config(cfg.saver)
        self.evaluator = FrequencyControl.from_config(cfg.evaluator)
        self.recover_timer = FrequencyControl.from_config(cfg.recover)
        ranks = Ranks(self.rank, self.world_size, self._all_gather)
        self.recover_dir = RecoverDir(self.run_dir / "recover", ranks, keep=cfg.recover.keep)
        fresh = not resume_pending(self.run_dir / "recover", cfg.recover.mode)
        self.stats_logger = StatsLogger(cfg.stats_logger, self.run_dir, self.rank, fresh=fresh)
        self.samples = SampleRecorder(
            cfg.stats_logger.samples, self.run_dir, self.rank, self.tokenizer, fresh=fresh
        )
        self.replay = ReplayRecorder(
            cfg.stats_logger.replay, self.run_dir, self.rank, self.world_size, fresh=fresh
        )
        self._bar = None
        self._last_commit: float | None = None
        self._loop_start: float | None = None  # time.monotonic() when steps() began
        self._saved: _Saved | None = None  # what Run.checkpoint saves (Run.resume registers it)
        self._last_step = 0  # the last step Run.steps yields (Run.end_at may lower it)

    def load_data(self) -> Data:
        """Tokenized train (and valid) datasets, sharded over the trainer ranks."""
        cfg, tok = self.cfg, self.tokenizer
        train = load_dataset(cfg.train_dataset, tok, cfg.seed)
        loader = create_dataloader(train, cfg.train_dataset, cfg.seed, self.rank, self.world_size)
        valid_loader = None
        if cfg.valid_dataset is not None:
            valid = load_dataset(cfg.valid_dataset, tok, cfg.seed)
            # rl items are scored by rollouts (no collective per batch): each held-out item once,
            # not the last batch padded with repeats; a forward pass (SFT, RM, DPO loss) needs
            # every rank in every batch, so those stay padded
            valid_loader = create_dataloader(
                valid, cfg.valid_dataset, cfg.seed, self.rank, self.world_size,
                pad=cfg.valid_dataset.type != "rl",
            )  # fmt: skip
        ft_spec = FinetuneSpec(
            cfg.total_train_epochs, len(train), cfg.train_dataset.batch_size, cfg.total_train_steps
        )
        return Data(loader, valid_loader, len(train), total_steps(cfg, len(loader)), ft_spec)

    def steps(self, start: int, n_steps: int, steps_per_epoch: int) -> Iterator[tuple[int, bool]]:
        """Yield ``(step, epoch_done)`` for steps ``start + 1 .. n_steps``. The saver and the
        evaluator learn the last step: their ``check`` is True there whatever their frequency,
        so a run always ends with an export and an evaluation."""
        self._last_step = self.saver.last_step = self.evaluator.last_step = n_steps
        self._loop_start = time.monotonic()  # the progress report's rate counts from here
        step = start
        while step < self._last_step:  # end_at may move it closer
            step += 1
            yield step, step % steps_per_epoch == 0

    def end_at(self, step: int) -> None:
        """Make ``step`` (the one :meth:`steps` just yielded) the run's last: no step follows;
        the saver and the evaluator fire at it as at the last step, and so does the recover
        timer when recovery is on (a relaunch with recover.mode=resume goes on from there)."""
        self._last_step = self.saver.last_step = self.evaluator.last_step = step
        if self.cfg.recover.mode != "disabled":
            self.recover_timer.last_step = step

    def batches(
        self, loader: _Loader[B], n_steps: int, start_step: int = 0
    ) -> Iterator[tuple[int, bool, B]]:
        """:meth:`steps` with each step's batch of ``loader``: ``(step, epoch_done, batch)``,
        starting a new epoch whenever one runs out (resumes where ``loader``'s state is)."""
        data = iter(loader)
        for step, epoch_done in self.steps(start_step, n_steps, len(loader)):
            try:
                batch = next(data)
            except StopIteration:  # next epoch
                data = iter(loader)
                batch = next(data)
            yield step, epoch_done, batch

    def barrier(self) -> None:
        """Wait for every trainer rank (no-op with one rank)."""
        self.dist.barrier()

    def _all_gather(self, obj: T) -> list[T]:
        """Every trainer rank's ``obj`` in rank order (the process group's timeout bounds it)."""
        if self.world_size == 1:
            return [obj]
        out = [obj] * self.world_size  # all_gather_object overwrites every slot with its rank's
        torch_dist.all_gather_object(out, obj, group=self.dist.mesh.get_group())
        return out

    def registry(self) -> NameRepository:
        """The trial's name registry (``cluster.name_resolve``)."""
        return make_repository(self.cfg.cluster.name_resolve, self.cfg.name_resolve_root)

    @property
    def servers_key(self) -> str:
        """Registry prefix under which this trial's generation servers are registered."""
        return gen_servers_key(self.cfg.experiment_name, self.cfg.trial_name)

    # -- logging ------------------------------------------------------------------------------

    def commit(self, step: int, total_steps: int, stats: dict[str, float]) -> None:
        """Log one step's metrics (rank 0) with step time, tokens/s and memory added, and
        advance the progress report (steps, rate, ETA; a bar or plain lines, see
        :mod:`areal.utils.progress`)."""
        now = time.perf_counter()
        stats = {**stats, **_memory_stats()}
        if self._last_commit is not None and step > 0:
            seconds = now - self._last_commit
            stats["perf/step_seconds"] = seconds
            if "perf/n_tokens" in stats:
                stats["perf/tokens_per_second"] = stats["perf/n_tokens"] / seconds
        self._last_commit = now
        if self.rank != 0:
            return
        if self._bar is None and step > 0:
            mode = self.env.progress_mode(sys.stderr.isatty())
            self._bar = StepProgress(total_steps, step - 1, mode, start=self._loop_start)
        if self._bar is not None:
            self._bar.update(stats)
        self.stats_logger.commit(step, stats)

    def log_trained(self, step: int, sample_ids: list[str]) -> None:
        """Append the ids trained at ``step`` to RUN_DIR/trained_samples-rank<r>.jsonl (the
        launch attempt is recorded, so a resumed run's effective sequence can be checked)."""
        attempt = self.env.attempt
        with open(self._trained_path, "a") as f:
            f.write(json.dumps({"step": step, "attempt": attempt, "ids": sample_ids}) + "\n")

    @property
    def _trained_path(self) -> Path:
        return self.run_dir / f"trained_samples-rank{self.rank}.jsonl"

    def close(self) -> None:
        """Close the progress report and stats sinks, then the process groups (end of the run)."""
        if self._bar is not None:
            self._bar.close()
        self.stats_logger.close()
        close_distributed()

    # -- checkpoints --------------------------------------------------------------------------

    def resume(
        self,
        engines: Mapping[str, Persistent],
        *,
        loader: Checkpointable | None = None,
        executor: Checkpointable | None = None,
        manager: Checkpointable | None = None,
        weights: Publisher | None = None,
    ) -> int:
        """The step to go on from: a recover checkpoint's (``engines`` loaded, then ``loader``,
        ``executor`` and ``manager`` restored, then ``weights`` published again at the
        checkpoint's version, in that order), else 0. Registers them all for
        :meth:`checkpoint`, which saves them under the same names: each engine's DCP dir, and
        ``dataloader``, ``executor``, ``manager``, ``version`` in each rank's state file.
        Collective; see :meth:`load_recover` for what a corrupt or refused checkpoint does."""
        named = {"dataloader": loader, "executor": executor, "manager": manager}
        parts = {key: part for key, part in named.items() if part is not None}
        self._saved = _Saved(dict(engines), parts, weights)
        state = self.load_recover(self._saved.engines)
        if state is None:
            return 0
        for key, part in parts.items():
            part.load_state_dict(state[key])
        if weights is not None:  # the servers get the checkpoint's weights and version
            weights.publish(state["version"])
        return state["step"]

    def checkpoint(self, step: int) -> None:
        """Write a recover checkpoint of what :meth:`resume` registered (collective)."""
        if self._saved is None:
            raise RuntimeError(
                "Run.checkpoint before Run.resume: resume names what a checkpoint holds; call "
                "it once before the step loop"
            )
        state: dict[str, object] = {k: p.state_dict() for k, p in self._saved.parts.items()}
        if self._saved.weights is not None:
            state["version"] = self._saved.weights.version
        self.save_recover(step, self._saved.engines, state)

    def export_hf(self, engine: Persistent, step: int, name: str = "actor") -> Path:
        """Save an HF model dir under RUN_DIR/checkpoints/<name>/step<step> (collective)."""
        path = self.run_dir / "checkpoints" / name / f"step{step}"
        engine.save(
            SaveLoadMeta(str(path), weight_format="hf", tokenizer_path=self.tokenizer.name_or_path)
        )
        return path

    def save_recover(
        self, step: int, engines: Mapping[str, Persistent], state: Mapping[str, object]
    ) -> None:
        """Write a recover checkpoint atomically: DCP per engine + this rank's ``state``."""
        timers = {k: t.state_dict() for k, t in self._timers().items()}
        with self.recover_dir.writing(step) as tmp:
            for name, engine in engines.items():
                engine.save(SaveLoadMeta(str(tmp / name), weight_format="dcp", with_optim=True))
            save_state(
                tmp, self.rank, {**state, "step": step, "timers": timers, "rng": rng_state()}
            )
        logger.info(
            f"recover checkpoint for step {step} in {self.recover_dir.root / f'ckpt-{step}'}"
        )

    def load_recover(self, engines: Mapping[str, Persistent]) -> dict[str, Any] | None:
        """Resume from the newest usable recover checkpoint when ``recover.mode`` allows (a
        corrupt one is named in a warning and the previous one tried); None when there is none.
        Writes RUN_DIR/config.yaml once the resume is accepted; a refused resume leaves it as it
        was and ends the process with the one-line ``RecoverError: ...`` message (exit code 1, no
        traceback: the operator's decision, not a crash; the launcher names it). Collective."""
        if self.cfg.recover.mode == "disabled":
            return None
        try:
            found = self.recover_dir.resume(lambda ckpt: self._load_checkpoint(ckpt, engines))
        except RecoverError as e:
            raise SystemExit(f"RecoverError: {e}") from None
        if found is None:
            return None
        ckpt, state = found
        if self.rank == 0:
            save_config(self.cfg, self.run_dir / "config.yaml")
            self.stats_logger.truncate_after(state["step"])
        self.samples.truncate_after(state["step"])
        self.replay.truncate_after(state["step"])
        repair_tail(self._trained_path)  # a killed run's half-written line: appends stay JSONL
        logger.info(f"resumed from {ckpt} at step {state['step']}")
        return state

    def _load_checkpoint(self, ckpt: Path, engines: Mapping[str, Persistent]) -> dict[str, Any]:
        """Every engine's DCP state, then this rank's state, timers and RNG from ``ckpt``; each
        part agreed by all ranks (a failure anywhere raises CheckpointError everywhere)."""
        agreed = self.recover_dir.agreed
        for name, engine in engines.items():
            meta = SaveLoadMeta(str(ckpt / name), weight_format="dcp", with_optim=True)
            agreed(lambda: engine.load(meta), f"loading {name} from {ckpt / name}")  # noqa: B023 - called at once
        state = agreed(
            lambda: load_state(ckpt, self.rank), f"loading {ckpt / f'state-rank{self.rank}.pt'}"
        )

        def restore() -> None:
            for name, timer in self._timers().items():
                timer.load_state_dict(state["timers"][name])
            set_rng_state(state["rng"])

        agreed(restore, f"restoring timers and RNG from {ckpt}")
        return state

    def _timers(self) -> dict[str, FrequencyControl]:
        return {"saver": self.saver, "evaluator": self.evaluator, "recover": self.recover_timer}


def _memory_stats() -> dict[str, float]:
    """Resident memory of this process now and at its peak (GiB), plus CUDA peak if used."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out = {"perf/memory_rss_gib": rss / 2**30, "perf/memory_peak_rss_gib": peak / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def die_with_starter(env: LaunchEnv) -> None:
    """A trainer rank under an areal launcher stops (SIGTERM) as soon as the process that
    started it exits: torchrun, or the launcher's process host. torchrun starts its workers in
    sessions of their own, so once it is SIGKILLed nothing else reaches them before the launcher
    itself exits, and a rank kept training (and writing stats) after the failure was declared."""
    if env.launcher_pid and env.launched:
        die_with(os.getppid(), what="process that started this rank (torchrun)")


def init_run(cfg: BaseExperimentConfig, model_path: str) -> Run:
    """Set up this trainer process: process group and mesh, seeds, log file, resolved config,
    tokenizer."""
    from transformers import AutoTokenizer

    problems = preflight(cfg)  # a script started without `areal launch` is checked here
    if problems:
        raise ConfigError(problems, "what the config points at")
    env = LaunchEnv.read()
    die_with_starter(env)
    if env.torch_threads:
        torch.set_num_threads(env.torch_threads)
    dist_ctx = init_distributed(cfg.cluster.dist_backend, env)
    rank = dist_ctx.rank
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    add_log_file(cfg.run_dir, f"trainer{rank}")
    if rank == 0 and not resume_pending(cfg.run_dir / "recover", cfg.recover.mode):
        save_config(cfg, cfg.run_dir / "config.yaml")  # else written once the resume is accepted
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or model_path)
    return Run(cfg, dist_ctx, env, tokenizer)


def total_steps(cfg: BaseExperimentConfig, steps_per_epoch: int) -> int:
    """Steps of the whole run: epochs x steps per epoch, capped by ``total_train_steps``."""
    n = cfg.total_train_epochs * steps_per_epoch
    return min(n, cfg.total_train_steps) if cfg.total_train_steps else n
