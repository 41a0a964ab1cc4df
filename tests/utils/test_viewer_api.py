"""Tier 1: the viewer's data side (no browser): filters over recorded samples, stats rows with
samples/s, and the errors a bad query or a missing sample gets."""

from __future__ import annotations

import json

import pytest

from areal.api.config.base import SamplesConfig
from areal.api.io import RolloutStatus, Trajectory
from areal.rollout.trajectory import groups_to_batch
from areal.runtime.samples import SampleRecorder
from areal.utils.viewer import RunData, parse_bounds


class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def _record(run_dir, step: int, versions: list[list[int]], version: int) -> None:
    groups = [
        [
            Trajectory(
                [1],
                [2] * len(v),
                [-1.0] * len(v),
                v,
                [1] * len(v),
                float(i),
                RolloutStatus.COMPLETED,
                sample_id=f"s{i}",
                group_id="g",
                server=["a:1", "b:2", "a:1,b:2"][i % 3],  # the third failed over from a to b
                worker=f"rank{step % 2}",
            )
            for i, v in enumerate(versions)
        ]
    ]  # one group
    batch = groups_to_batch(groups)
    SampleRecorder(SamplesConfig(), run_dir, 0, _Tok(), fresh=False).record(
        step, groups, batch.with_fields(tokens={"advantages": batch["loss_mask"].float()}), version
    )


def test_filters_select_samples_by_step_reward_staleness_and_length(tmp_path):
    _record(tmp_path, 1, [[0, 0], [0]], version=0)  # two samples, staleness 0, lengths 2 and 1
    _record(tmp_path, 2, [[0, 1], [1, 1, 1]], version=1)  # staleness 1 and 0, lengths 2 and 3
    (tmp_path / "stats.jsonl").write_text(
        json.dumps({"step": 2, "perf/step_seconds": 0.5}) + "\n{half"
    )
    run = RunData(tmp_path)
    assert run.table({})["total"] == 4
    assert [(r["step"], r["index"]) for r in run.table({"staleness_min": "1"})["rows"]] == [(2, 0)]
    assert run.table({"step_min": "2", "length_max": "2"})["total"] == 1
    assert run.table({"reward_min": "1", "reward_max": "1"})["total"] == 2
    assert run.stats() == [
        {"step": 2, "perf/step_seconds": 0.5, "perf/samples_per_second": 4.0}
    ]  # 2 / 0.5 s
    assert run.samples.sample(2, 0, 1)["versions"] == [1, 1, 1]


def test_server_and_worker_filters_pick_the_samples_that_came_from_them(tmp_path):
    _record(tmp_path, 1, [[0], [0], [0]], version=0)  # servers a:1, b:2, a:1+b:2; worker rank1
    _record(tmp_path, 2, [[1]], version=1)  # server a:1, worker rank0
    run = RunData(tmp_path)
    picked = run.table({"server": "b:2"})
    assert [(r["step"], r["index"]) for r in picked["rows"]] == [(1, 1), (1, 2)]
    assert picked["choices"] == {"server": ["a:1", "b:2"], "worker": ["rank0", "rank1"]}
    assert run.table({"server": "a:1", "worker": "rank1"})["total"] == 2
    assert run.table({"worker": "rank0"})["rows"][0]["server"] == "a:1"


def test_bad_query_and_missing_sample_name_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="reward_max='high' is not a number"):
        parse_bounds({"reward_max": "high"})
    _record(tmp_path, 1, [[0]], version=0)
    with pytest.raises(KeyError, match="holds 1 samples; index 5"):
        RunData(tmp_path).samples.sample(1, 0, 5)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        RunData(tmp_path / "nope")


def test_timeline_keeps_each_steps_last_record_and_skips_a_half_written_line(tmp_path):
    from areal.utils.samples import read_timeline

    assert read_timeline(tmp_path) == []  # a Lite run has none
    lines = [
        {"step": 1, "seconds": 2.0, "spans": []},
        {"step": 2, "seconds": 9.0, "spans": []},  # the step a resume redid ...
        {"step": 2, "seconds": 3.0, "spans": [{"worker": 0, "name": "actor_train"}]},  # ... again
    ]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "spa'
    (tmp_path / "timeline.jsonl").write_text(text)
    got = read_timeline(tmp_path)
    assert [(t["step"], t["seconds"]) for t in got] == [(1, 2.0), (2, 3.0)]
