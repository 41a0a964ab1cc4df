"""Trained samples on disk, for ``areal view``: one Parquet file per recorded step and rank.

``RUN_DIR/samples/step-<step:06d>-rank<r>.parquet`` holds one row per trained sequence of that
step on that rank (columns: the module docstring). Each file is written to a temporary name and
renamed, so a killed run leaves every step it finished readable and no half-written file. A
resume drops the files of steps after its checkpoint (they are trained, and recorded, again). A
fresh run of the same trial moves an earlier run's ``samples/`` aside to ``samples.<k>``, as
:class:`~areal.utils.stats_logger.StatsLogger` does with stats.jsonl.

Columns: ``step``, ``rank``, ``index`` (position in that rank's batch), ``group``, ``sample_id``,
``status``, ``reward``, ``advantage`` (mean over its trained tokens), ``trainer_version`` (the
weights it was trained on), ``staleness`` (trainer_version minus the oldest version among its
trained tokens), ``prompt_len``, ``length`` (completion tokens), ``server`` (the generation
server(s), host:port), ``worker`` (the rollout worker: Lite ``rank<r>``, Core ``worker<i>``),
``turn_starts`` (multi-turn and agent samples: where each model turn starts in the completion;
[] for one turn), ``prompt_text``, ``completion_text``, ``reference`` (the item's reference
answer; null when the workflow gave none), ``prompt_ids``, ``completion_ids``, and
per completion token ``completion_tokens`` (each decoded on its own), ``versions`` (-1:
injected, not sampled), ``loss_mask``, ``behav_logp`` (the server's), ``trainer_logp``,
``advantages``.

Per-token lists cover the completion only. ``trainer_logp`` is the trainer's logprob of each
token: the proximal pass's (``prox_logp``, the weights before the update) when the step ran one,
else the update's own forward (``ppo_update(logp_out="trainer_logp")``: the same weights with one
minibatch); null only when the batch has neither.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.utils.batch import PackedBatch
from areal.utils.logging import get_logger
from areal.utils.recover import move_aside
from areal.utils.samples import SAMPLES_DIR, sample_files

if TYPE_CHECKING:
    from areal.api.config.base import SamplesConfig
    from areal.api.io import Trajectory

logger = get_logger("samples")


class SampleRecorder:
    """Writes each recorded step's trained samples of this rank (see the module docstring)."""

    def __init__(
        self, cfg: SamplesConfig, run_dir: str | Path, rank: int, tokenizer: Any, fresh: bool = True
    ):
        """``fresh``: a new run of the trial; an earlier run's samples dir is moved aside."""
        self.cfg = cfg
        self.root = Path(run_dir) / SAMPLES_DIR
        self.rank = rank
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}  # decoded single tokens, by id
        self._full = False
        if not cfg.enabled:
            return
        if fresh and rank == 0 and self.root.is_dir() and any(self.root.iterdir()):
            moved = move_aside(self.root)
            logger.warning(
                f"{self.root} held the samples of an earlier run of this trial; moved to {moved}"
            )
        self._bytes = sum(
            p.stat().st_size for p in self.root.glob("*.parquet")
        )  # a resume's so far

    def record(
        self, step: int, groups: Sequence[Sequence[Trajectory]], batch: PackedBatch, version: int
    ) -> None:
        """Write the samples of ``step`` (``groups`` as trained, ``batch`` with ``advantages``,
        ``version`` the trainer's weights they were trained on) when this step is kept."""
        if not self.cfg.enabled or self._full or step % self.cfg.keep_every:
            return
        if self.cfg.max_bytes and self._bytes >= self.cfg.max_bytes:
            self._full = True
            logger.warning(
                f"{self.root} holds {self._bytes} bytes >= stats_logger.samples.max_bytes="
                f"{self.cfg.max_bytes}; no more samples are recorded (raise it, or record fewer "
                "steps with stats_logger.samples.keep_every)"
            )
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = self.rows(step, groups, batch, version)
        self.root.mkdir(
            parents=True, exist_ok=True
        )  # here: rank 0 may move an old one aside at start
        path = self.root / f"step-{step:06d}-rank{self.rank}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp, compression="zstd")
        os.replace(tmp, path)
        self._bytes += path.stat().st_size

    def rows(
        self, step: int, groups: Sequence[Sequence[Trajectory]], batch: PackedBatch, version: int
    ) -> list[dict[str, Any]]:
        """One dict per sequence of ``batch`` (columns: the module docstring)."""
        trajs = [t for g in groups for t in g]
        if len(trajs) != batch.n_seqs:
            raise ValueError(
                f"{len(trajs)} trajectories but the batch holds {batch.n_seqs} sequences; "
                "record the batch groups_to_batch built from these groups"
            )
        cu: list[int] = batch.cu_seqlens.tolist()
        trainer = "prox_logp" if "prox_logp" in batch else "trainer_logp"
        token = {  # one host transfer per field and batch
            k: batch[k].detach().cpu().tolist()
            for k in ("logprobs", "advantages", trainer)
            if k in batch
        }
        rows = []
        for i, t in enumerate(trajs):
            lo, hi = cu[i] + len(t.prompt_ids), cu[i + 1]  # the completion's tokens in the batch
            mask = [int(m) for m in batch["loss_mask"][lo:hi].tolist()]
            trained = [v for v, m in zip(t.versions, mask) if m and v >= 0]
            adv = token.get("advantages", [0.0] * hi)[lo:hi]
            n_trained = sum(mask)
            rows.append(
                {
                    "step": step,
                    "rank": self.rank,
                    "index": i,
                    "group": t.group_id,
                    "sample_id": t.sample_id,
                    "status": t.status.value,
                    "reward": float(t.reward),
                    "advantage": sum(a for a, m in zip(adv, mask) if m) / n_trained
                    if n_trained
                    else 0.0,
                    "trainer_version": version,
                    "staleness": version - min(trained) if trained else 0,
                    "prompt_len": len(t.prompt_ids),
                    "length": len(t.completion_ids),
                    "server": t.server,
                    "worker": t.worker,
                    "turn_starts": list(t.turn_starts),
                    "prompt_text": t.prompt_text or self.tokenizer.decode(t.prompt_ids),
                    "completion_text": t.completion_text or self.tokenizer.decode(t.completion_ids),
                    "reference": t.reference or None,  # None: the workflow recorded none
                    "prompt_ids": list(t.prompt_ids),
                    "completion_ids": list(t.completion_ids),
                    "completion_tokens": [self._decode(x) for x in t.completion_ids],
                    "versions": list(t.versions),
                    "loss_mask": mask,
                    "behav_logp": token["logprobs"][lo:hi],
                    "trainer_logp": token[trainer][lo:hi] if trainer in token else None,
                    "advantages": adv,
                }
            )
        return rows

    def truncate_after(self, step: int) -> None:
        """Drop this rank's files of steps after ``step`` (a resume records them again)."""
        for s, rank, path in sample_files(self.root.parent):
            if rank == self.rank and s > step:
                path.unlink()

    def _decode(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
