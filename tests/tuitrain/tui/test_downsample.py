"""Charts draw at most a limit of points; groups keep their peak (or their mean)."""

import pytest

from tuitrain.tui.downsample import downsample, mean


def test_few_samples_come_back_unchanged():
    assert downsample([1, 2, 3], [5.0, 6.0, 7.0], 10) == ([1, 2, 3], [5.0, 6.0, 7.0])


def test_groups_end_at_their_last_step_and_keep_their_peak():
    steps = list(range(1, 11))
    values = [0, 9, 0, 0, 0, 0, 0, 0, 0, 7]
    xs, ys = downsample(steps, values, 2)
    assert xs == [5, 10]
    assert ys == [9, 7]


def test_a_mean_smooths_instead():
    xs, ys = downsample([1, 2, 3, 4], [1.0, 3.0, 5.0, 7.0], 2, reduce=mean)
    assert (xs, ys) == ([2, 4], [2.0, 6.0])


def test_every_sample_lands_in_exactly_one_group():
    steps = list(range(1000))
    xs, ys = downsample(steps, [1.0] * 1000, 7, reduce=sum)
    assert len(xs) == 7 and xs[-1] == 999 and sum(ys) == 1000


def test_mismatched_or_empty_limits_are_refused():
    with pytest.raises(ValueError):
        downsample([1, 2], [1.0], 5)
    with pytest.raises(ValueError):
        downsample([1], [1.0], 0)
