"""Tier 1: the sample recorder's rows, its keep_every / max_bytes bounds and resume truncation."""

from __future__ import annotations

import pyarrow.parquet as pq

from areal.api.config.base import SamplesConfig
from areal.api.io import RolloutStatus, Trajectory
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.samples import SampleRecorder
from areal.utils.samples import sample_files


class _Tok:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _groups():
    def traj(i, versions, reward):
        return Trajectory(
            [1, 2],
            [3 + i, 4, 5],
            [-0.5, -1.0, -2.0],
            versions,
            [1, 1, 1],
            reward,
            RolloutStatus.COMPLETED,
            sample_id=f"g0-{i}",
            group_id="g0",
            server=f"127.0.0.1:{7000 + i}",
            worker="rank0",
            turn_starts=[0, 2] if i else [],  # sample 1: two model turns, the second at token 2
        )

    return [[traj(0, [3, 4, 4], 1.0), traj(1, [4, 4, 4], 0.0)]]


def _batch(groups):
    batch = groups_to_batch(groups)
    adv = batch["loss_mask"].float() * 0.5  # 0.5 on completion tokens, 0 on prompts
    return batch.with_fields(tokens={"advantages": adv})


def test_recorded_rows_carry_tokens_versions_logprobs_and_staleness(tmp_path):
    rec = SampleRecorder(SamplesConfig(), tmp_path, rank=0, tokenizer=_Tok())
    groups = _groups()
    rec.record(1, groups, _batch(groups), version=4)
    [(step, rank, path)] = sample_files(tmp_path)
    rows = pq.read_table(path).to_pylist()
    assert (step, rank, len(rows)) == (1, 0, 2)
    first = rows[0]
    assert first["staleness"] == 1 and rows[1]["staleness"] == 0  # 4 - min(3, 4, 4)
    assert first["versions"] == [3, 4, 4] and first["behav_logp"] == [-0.5, -1.0, -2.0]
    assert first["completion_tokens"] == ["d", "e", "f"] and first["advantage"] == 0.5
    assert first["trainer_logp"] is None and first["length"] == 3 and first["group"] == "g0"
    assert (first["server"], first["worker"]) == ("127.0.0.1:7000", "rank0")
    assert first["turn_starts"] == [] and rows[1]["turn_starts"] == [0, 2]


def test_trainer_logp_is_the_prox_pass_when_there_is_one_else_the_updates_own(tmp_path):
    groups = _groups()
    batch = _batch(groups)  # [T] = 2 x (2 prompt + 3 completion) tokens
    own = batch.with_fields(tokens={"trainer_logp": batch["logprobs"] - 0.25})
    rec = SampleRecorder(SamplesConfig(), tmp_path / "own", rank=0, tokenizer=_Tok())
    rec.record(1, groups, own, version=4)
    rows = pq.read_table(sample_files(tmp_path / "own")[0][2]).to_pylist()
    assert rows[0]["trainer_logp"] == [-0.75, -1.25, -2.25]  # the completion's only
    prox = own.with_fields(tokens={"prox_logp": batch["logprobs"] + 0.5})
    rec = SampleRecorder(SamplesConfig(), tmp_path / "prox", rank=0, tokenizer=_Tok())
    rec.record(1, groups, prox, version=4)
    rows = pq.read_table(sample_files(tmp_path / "prox")[0][2]).to_pylist()
    assert rows[1]["trainer_logp"] == [0.0, -0.5, -1.5]


def test_keep_every_and_max_bytes_bound_what_is_recorded(tmp_path):
    groups = _groups()
    rec = SampleRecorder(SamplesConfig(keep_every=2), tmp_path / "a", rank=0, tokenizer=_Tok())
    for step in range(1, 5):
        rec.record(step, groups, _batch(groups), version=4)
    assert [s for s, _, _ in sample_files(tmp_path / "a")] == [2, 4]
    rec = SampleRecorder(SamplesConfig(max_bytes=1), tmp_path / "b", rank=0, tokenizer=_Tok())
    for step in range(1, 4):
        rec.record(step, groups, _batch(groups), version=4)
    assert [s for s, _, _ in sample_files(tmp_path / "b")] == [1]  # over the limit after the first


def test_resume_drops_later_steps_and_a_fresh_run_moves_old_samples_aside(tmp_path):
    groups = _groups()
    rec = SampleRecorder(SamplesConfig(), tmp_path, rank=0, tokenizer=_Tok())
    for step in (1, 2, 3):
        rec.record(step, groups, _batch(groups), version=4)
    rec.truncate_after(1)
    assert [s for s, _, _ in sample_files(tmp_path)] == [1]
    SampleRecorder(SamplesConfig(), tmp_path, rank=0, tokenizer=_Tok(), fresh=True)
    assert (
        sample_files(tmp_path) == []
        and (tmp_path / "samples.1" / "step-000001-rank0.parquet").is_file()
    )
