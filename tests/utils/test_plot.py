import json

import pytest

from areal.utils.plot import plot_run


def test_plot_writes_a_png_from_stats_jsonl(tmp_path):
    rows = [
        {"step": 1, "reward/mean": 0.1, "timing/rollout": 2.0, "timing/train": 1.0},
        {"step": 2, "reward/mean": 0.3, "eval/accuracy": 0.25, "timing/rollout": 1.5},
    ]
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_run(tmp_path)
    assert out == tmp_path / "plot.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_skips_a_half_written_last_line_of_a_running_or_killed_run(tmp_path):
    row = {"step": 1, "reward/mean": 0.1, "timing/rollout": 2.0}
    (tmp_path / "stats.jsonl").write_text(json.dumps(row) + '\n{"step": 2, "rew')
    assert plot_run(tmp_path).is_file()


def test_plot_of_a_dir_without_stats_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="stats.jsonl not found"):
        plot_run(tmp_path)


def test_plot_of_a_run_dir_that_is_not_there_says_so_not_which_logger_to_enable(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory") as e:
        plot_run(tmp_path / "typo")
    assert "stats_logger" not in str(e.value)


def test_each_run_type_gets_the_panels_of_what_it_logged():
    from areal.utils.plot import panels

    rl = [
        {
            "step": 1,
            "reward/mean": 0.1,
            "eval/accuracy": 0.2,
            "loss/pg_loss": 0.0,
            "timing/train": 1.0,
        }
    ]
    sft = [
        {"step": 1, "loss/loss": 2.0, "timing/train": 1.0},
        {"step": 2, "loss/loss": 1.5, "eval/loss": 1.6},
    ]
    rm = [{"step": 1, "loss/loss": 0.7, "loss/pair_acc": 0.5}]

    def titles(rows: list[dict]) -> list[str]:
        return [t for t, _ in panels(rows)]

    assert titles(rl) == [
        "mean reward (training rollouts)",
        "held-out accuracy",
        "seconds per stage",
    ]
    assert titles(sft) == ["loss", "seconds per stage"]
    assert titles(rm) == ["loss", "pair accuracy (reward model)", "seconds per stage"]


def test_a_core_async_run_gets_lag_buffer_refusal_and_worker_panels():
    from areal.utils.plot import panels

    row = {
        "step": 1,
        "reward/mean": 0.1,
        "core/lag/max": 1.0,
        "manager/buffered": 2.0,
        "manager/refused/staleness": 5.0,
        "rollout_worker/0/tokens_per_s": 9.0,
        "rollout_worker/3/tokens_per_s": 7.0,
        "rollout_worker/0/episodes": 4.0,
    }
    got = dict(panels([row]))
    assert got["rollout worker tokens/s (Core async)"] == [
        "rollout_worker/0/tokens_per_s",
        "rollout_worker/3/tokens_per_s",
    ]
    assert "version lag of trained samples (Core async)" in got
    assert "admission refusals, asks so far (Core async)" in got
