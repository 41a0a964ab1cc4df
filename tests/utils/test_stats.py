import json
import os

import pytest
import torch
import torch.distributed as dist

from areal.api.config import StatsLoggerConfig
from areal.utils.network import free_port
from areal.utils.stats import StatsTracker
from areal.utils.stats_logger import StatsLogger
from tests.ranks import run_ranks


def test_masked_mean_counts_only_masked_elements():
    t = StatsTracker()
    with t.scope("loss"):
        # (1*1 + 2*0 + 3*1) / (1 + 0 + 1) = 2.0
        t.mean("x", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 1]))
        # second record: (5*1) -> (1 + 3 + 5) / 3 = 3.0 (mean over all elements, not of means)
        t.mean("x", torch.tensor([5.0]), torch.tensor([1]))
        t.sum("n", torch.tensor([2, 3]))
        t.max("m", torch.tensor([1.0, 9.0, 4.0]), torch.tensor([1, 0, 1]))
        t.min("m2", torch.tensor([1.0, -9.0, 4.0]), torch.tensor([1, 0, 1]))
    out = t.export()
    assert out == {"loss/x": 3.0, "loss/n": 5.0, "loss/m": 4.0, "loss/m2": 1.0}
    assert t.export() == {}  # export resets


def test_mean_with_empty_mask_is_left_out_not_zero():
    t = StatsTracker()
    t.mean("x", torch.tensor([1.0]), torch.tensor([0]))
    assert t.export() == {}


def test_timer_accumulates_under_timing_namespace():
    t = StatsTracker()
    with t.scope("step"), t.timer("rollout"):
        pass
    out = t.export()
    assert list(out) == ["timing/step/rollout"] and out["timing/step/rollout"] >= 0


def test_recording_one_name_with_two_kinds_is_an_error():
    t = StatsTracker()
    t.sum("a", 1.0)
    with pytest.raises(ValueError, match="'a' was recorded as 'sum'"):
        t.mean("a", 1.0)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=60)
    )
    t = StatsTracker()
    if rank == 0:
        t.mean("tok", torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))  # 3 over 2 tokens
        t.max("mx", torch.tensor([5.0]))
        t.sum("only_rank0", 1.0)
    else:
        t.mean("tok", torch.tensor([10.0, 0.0, 7.0]), torch.tensor([1, 0, 0]))  # 10 over 1 token
        t.max("mx", torch.tensor([2.0]))
        t.min("only_rank1", torch.tensor([-3.0]))
    out = t.export()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_export_reduces_across_two_gloo_ranks(tmp_path):
    run_ranks(_worker, 2, (free_port(), str(tmp_path)))
    # token mean over both ranks: (1 + 2 + 10) / 3 tokens = 13/3; max(5, 2) = 5; names unioned
    expected = {"tok": 13 / 3, "mx": 5.0, "only_rank0": 1.0, "only_rank1": -3.0}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got == pytest.approx(expected)


def test_stats_logger_writes_jsonl_and_tensorboard(tmp_path):
    cfg = StatsLoggerConfig(console=True, jsonl=True, tensorboard=True)
    log = StatsLogger(cfg, tmp_path)
    log.commit(1, {"reward/mean": 0.5, "loss/x": float("nan")})
    log.commit(2, {"reward/mean": 0.75})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and "loss/x" not in rows[0]  # non-finite dropped
    assert any((tmp_path / "tensorboard").iterdir())


def test_stats_logger_on_nonzero_rank_writes_nothing(tmp_path):
    log = StatsLogger(StatsLoggerConfig(), tmp_path / "r1", rank=1)
    log.commit(1, {"a": 1.0})
    assert not (tmp_path / "r1").exists()


def test_a_rerun_of_a_trial_starts_a_new_stats_file_and_a_resume_drops_the_steps_it_redoes(
    tmp_path,
):
    import json

    from areal.api.config import StatsLoggerConfig

    cfg = StatsLoggerConfig(console=False, tensorboard=False)
    first = StatsLogger(cfg, tmp_path)
    for step in (1, 2, 3):
        first.commit(step, {"loss": float(step)})
    first.close()
    rerun = StatsLogger(cfg, tmp_path)  # a fresh run of the same trial: steps would restart at 1
    rerun.commit(1, {"loss": 9.0})
    rerun.close()

    def steps(name: str) -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]

    assert steps("stats.jsonl.1") == [1, 2, 3] and steps("stats.jsonl") == [1]
    resumed = StatsLogger(cfg, tmp_path, fresh=False)  # a resume appends...
    for step in (2, 3):
        resumed.commit(step, {"loss": float(step)})
    resumed.truncate_after(2)  # ...and a resume from step 2's checkpoint redoes step 3
    resumed.commit(3, {"loss": 3.5})
    resumed.close()
    assert steps("stats.jsonl") == [1, 2, 3]


def test_a_resume_skips_a_half_written_last_stats_line_and_keeps_the_file_valid_jsonl(tmp_path):
    import json

    from areal.api.config import StatsLoggerConfig

    cfg = StatsLoggerConfig(console=False, tensorboard=False)
    first = StatsLogger(cfg, tmp_path)
    for step in (1, 2):
        first.commit(step, {"loss": float(step)})
    first.close()
    path = tmp_path / "stats.jsonl"
    with open(path, "a") as f:  # the run was killed in the middle of step 3's line
        f.write('{"step": 3, "time": 1.0, "lo')
    resumed = StatsLogger(cfg, tmp_path, fresh=False)  # no crash: the half line is cut off
    resumed.truncate_after(2)
    resumed.commit(3, {"loss": 3.0})
    resumed.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] == 3.0


def test_truncate_after_drops_an_invalid_or_empty_line_instead_of_raising(tmp_path):
    import json

    from areal.api.config import StatsLoggerConfig

    cfg = StatsLoggerConfig(console=False, tensorboard=False)
    path = tmp_path / "stats.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n\n[1, 2]\n{"step": 2, "loss": 2.0}\n{"step": 3,\n')
    resumed = StatsLogger(cfg, tmp_path, fresh=False)
    resumed.truncate_after(2)
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
