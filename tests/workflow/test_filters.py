import pytest

from areal.api.io import RolloutStatus, Trajectory
from areal.workflow.filters import DynamicSamplingFilter


def _group(*rewards):
    return [Trajectory([1], [2], [0.0], [0], [1], r, RolloutStatus.COMPLETED) for r in rewards]


def test_uniform_groups_are_rejected_mixed_ones_accepted():
    f = DynamicSamplingFilter(max_consecutive_rejections=10)
    assert f(_group(1.0, 0.0, 1.0)) is True
    assert f(_group(0.0, 0.0, 0.0)) is False
    assert f(_group(1.0, 1.0)) is False


def test_an_accepted_group_resets_the_rejection_streak():
    f = DynamicSamplingFilter(max_consecutive_rejections=3)
    f(_group(0.0, 0.0))
    f(_group(0.0, 0.0))  # streak 2
    f(_group(0.0, 1.0))  # reset
    f(_group(0.0, 0.0))
    assert f(_group(0.0, 0.0)) is False  # streak 2 < 3: still no error


def test_too_many_rejections_in_a_row_stop_the_run_with_the_fix():
    f = DynamicSamplingFilter(max_consecutive_rejections=2)
    f(_group(0.0, 0.0))
    with pytest.raises(
        RuntimeError, match="rejected 2 groups in a row.*actor.dynamic_sampling=false"
    ):
        f(_group(0.0, 0.0))


def test_a_run_that_never_scores_is_asked_whether_it_started_from_the_right_model():
    f = DynamicSamplingFilter(max_consecutive_rejections=1)
    with pytest.raises(RuntimeError, match="never: is actor.path a model warmed up for this task"):
        f(_group(0.0, 0.0))
    f = DynamicSamplingFilter(max_consecutive_rejections=1)
    with pytest.raises(RuntimeError, match="always: use harder data"):
        f(_group(1.0, 1.0))
