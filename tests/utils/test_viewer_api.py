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


def _record(run_dir, step: int, versions: list[list[int]], version: int, **fields) -> None:
    """Record one group of ``versions``' samples at ``step`` (``fields``: more Trajectory
    fields, the same for each sample)."""
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
                **fields,
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


def _get(app, paths: list[str]) -> list[tuple[int, str]]:
    """``(status, body)`` of GET ``paths`` from the viewer ``app`` over loopback."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return [(r.status, await r.text()) for r in [await client.get(p) for p in paths]]

    return asyncio.run(run())


def _strict(text: str):
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are errors."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_an_empty_or_truncated_sample_file_is_skipped_and_the_curves_stay(tmp_path, caplog):
    from areal.utils.viewer import make_app

    _record(tmp_path, 1, [[0], [0]], version=0)
    _record(tmp_path, 2, [[1]], version=1)
    _record(tmp_path, 3, [[1]], version=1)
    samples = tmp_path / "samples"
    (samples / "step-000002-rank0.parquet").write_bytes(b"")  # empty
    step3 = samples / "step-000003-rank0.parquet"
    step3.write_bytes(step3.read_bytes()[:100])  # truncated
    stats = [{"step": s, "perf/step_seconds": 1.0, "reward/mean": 0.5} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in stats) + "\n[1, 2]\n" + '{"step": 4, "rew'
    (tmp_path / "stats.jsonl").write_text(text)
    timeline = '{"step": 1, "seconds": 1.0, "spans": []}\n""\n{"step": [2]}\n{"st'
    (tmp_path / "timeline.jsonl").write_text(timeline)
    app = make_app([tmp_path])
    paths = ["/api/stats/0", "/api/samples/0", "/api/sample/0/3/0/0", "/api/timeline/0"]
    paths.append(f"/api/sample/0/{'9' * 300}/0/0")  # a file name past the file system's limit
    with caplog.at_level("WARNING"):  # the page re-reads every 5 s: each bad piece warned once
        (s1, stats_body), (s2, table), (s3, one), (s4, timeline), (s5, _), *_ = _get(app, paths * 2)
    assert (s1, s2, s3, s4, s5) == (200, 200, 404, 200, 404)
    assert [r["step"] for r in _strict(stats_body)] == [1, 2, 3]  # every curve point is there
    assert _strict(stats_body)[0]["perf/samples_per_second"] == 2.0  # 2 samples / 1 s
    assert [r["step"] for r in _strict(table)["rows"]] == [1, 1]  # steps 2 and 3 skipped
    assert "unreadable" in one and "step-000003-rank0.parquet" in one
    assert [r["step"] for r in _strict(timeline)] == [1]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("step-000002-rank0.parquet: unreadable (0 bytes" in w for w in warned) == 1
    assert sum("step-000003-rank0.parquet: unreadable" in w for w in warned) == 1
    assert sum("stats.jsonl:5: not a JSON object" in w for w in warned) == 1  # the [1, 2] line


def test_a_non_finite_reward_is_strict_json_and_the_sample_still_shows(tmp_path):
    from areal.utils.viewer import make_app

    _record(tmp_path, 1, [[0], [0]], version=0)
    import pyarrow.parquet as pq

    path = tmp_path / "samples" / "step-000001-rank0.parquet"
    table = pq.read_table(path).to_pylist()
    table[0]["reward"], table[1]["reward"] = float("nan"), float("inf")
    table[0]["behav_logp"] = [float("-inf")]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path)
    (tmp_path / "stats.jsonl").write_text('{"step": 1, "reward/mean": NaN}\n')
    got = _get(make_app([tmp_path]), ["/api/samples/0", "/api/sample/0/1/0/0", "/api/stats/0"])
    assert [s for s, _ in got] == [200, 200, 200]
    rows = _strict(got[0][1])["rows"]
    assert [r["reward"] for r in rows] == ["NaN", "Infinity"]
    one = _strict(got[1][1])
    assert one["reward"] == "NaN" and one["behav_logp"] == ["-Infinity"]
    assert _strict(got[2][1]) == [{"step": 1, "reward/mean": "NaN"}]
    assert RunData(tmp_path).table({"reward_min": "0"})["total"] == 1  # inf >= 0; NaN is not


def test_a_bad_limit_is_a_400_naming_it(tmp_path):
    from areal.utils.viewer import make_app

    got = _get(make_app([tmp_path]), ["/api/samples/0?limit=lots", "/api/samples/0?limit=-1"])
    assert [s for s, _ in got] == [400, 400] and "limit='lots' is not a row count" in got[0][1]


def test_areal_view_on_a_taken_port_is_one_line_naming_it_and_the_fix(tmp_path, capsys):
    import socket

    from areal.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port N" in err
    assert main(["view", str(tmp_path), "--allowed-host", "http://x:1"]) == 2
    assert "--allowed-host: 'http://x:1' is not a bare host name" in capsys.readouterr().err


def test_a_sample_page_carries_its_prompt_and_reference_answer(tmp_path):
    from areal.utils.viewer import make_app

    _record(tmp_path, 1, [[0]], version=0, prompt_text="What is 3 + 4?", reference="7")
    _record(tmp_path, 2, [[1]], version=1)  # a workflow without a reference (agent episodes)
    got = _get(make_app([tmp_path]), ["/api/sample/0/1/0/0", "/api/sample/0/2/0/0"])
    one, other = (_strict(body) for _, body in got)
    assert (one["prompt_text"], one["reference"]) == ("What is 3 + 4?", "7")
    assert other["reference"] is None and other["prompt_text"] == "1"  # decoded prompt_ids


def test_a_reference_answer_that_is_not_text_is_recorded_as_json():
    from areal.workflow.rlvr import reference_text

    assert reference_text("42") == "42"
    assert reference_text({"tests": [1, 2]}) == '{"tests": [1, 2]}'


def test_areal_view_on_a_non_loopback_host_warns_and_names_the_ssh_tunnel(tmp_path):
    import subprocess
    import sys
    import urllib.request

    from areal.utils.viewer import exposure_warning

    assert [exposure_warning(h, 8765) for h in ("127.0.0.1", "::1", "localhost")] == [""] * 3
    assert "ssh -L 8765:127.0.0.1:8765" in exposure_warning("0.0.0.0", 8765)
    cmd = [sys.executable, "-m", "areal.cli", "view", str(tmp_path), "--host", "0.0.0.0"]
    proc = subprocess.Popen([*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = proc.stdout.readline().decode().split()[2]  # http://0.0.0.0:<port>/
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        assert url.startswith("http://0.0.0.0:")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=10) as r:
            assert r.status == 200  # it listens on every interface, loopback too
    finally:
        proc.terminate()
        err = proc.communicate(timeout=10)[1].decode()
    assert f"listening on 0.0.0.0:{port}" in err and f"ssh -L {port}:127.0.0.1:{port}" in err
