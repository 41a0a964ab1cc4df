import pytest

from areal.utils.recover import RecoverDir, load_state, save_state


def test_latest_is_none_before_any_checkpoint(tmp_path):
    assert RecoverDir(tmp_path / "recover").latest() is None


def test_checkpoint_is_published_only_after_the_write_completes(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    with rd.writing(3) as d:
        save_state(d, 0, {"step": 3, "order": [5, 1]})
        assert rd.latest() is None  # not visible while being written
    assert rd.latest().name == "ckpt-3"
    assert load_state(rd.latest(), 0) == {"step": 3, "order": [5, 1]}


def test_crash_during_write_leaves_previous_checkpoint_usable(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    with rd.writing(1) as d:
        save_state(d, 0, {"step": 1})
    with pytest.raises(KeyboardInterrupt):
        with rd.writing(2) as d:
            save_state(d, 0, {"step": 2})
            raise KeyboardInterrupt  # the process dies mid-write
    assert rd.latest().name == "ckpt-1" and load_state(rd.latest(), 0) == {"step": 1}
    with rd.writing(2) as d:  # the next attempt cleans the leftover temp dir
        save_state(d, 0, {"step": 2})
    assert load_state(rd.latest(), 0) == {"step": 2}
    assert not (tmp_path / "recover" / "ckpt-1").exists()  # keep=1 prunes older ones


def test_missing_rank_state_names_the_fix(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    with rd.writing(1) as d:
        save_state(d, 0, {})
    with pytest.raises(RuntimeError, match="same cluster.trainer_nprocs"):
        load_state(rd.latest(), 1)
