"""Numbers on the screen."""

from tuitrain.formatting import format_count, format_rate, format_seconds
from tuitrain.tui.axes import size_unit, step_ticks


def test_counts_rates_and_durations():
    assert [format_count(n) for n in (812, 12_345, 125_239_296, 1_315_758_080)] == [
        "812",
        "12.3k",
        "125.2M",
        "1.3B",
    ]
    assert format_rate(1234.4) == "1,234" and format_rate(25_000) == "25.0k"
    assert [format_seconds(s) for s in (0.0, 0.00085, 0.0125, 1.234, 125)] == [
        "0 s",
        "850 µs",
        "12.5 ms",
        "1.23 s",
        "2m05s",
    ]


def test_charts_pick_gib_or_mib():
    assert size_unit(6 * 1024**3) == ("GiB", 1024**3)
    assert size_unit(300 * 1024**2) == ("MiB", 1024**2)


def test_step_axis_labels_are_whole_steps_with_both_ends():
    assert step_ticks([3, 4, 5]) == [3, 4, 5]
    assert step_ticks(list(range(1, 122))) == [1, 31, 61, 91, 121]


def test_step_axis_labels_are_evenly_spaced_in_a_short_window():
    assert step_ticks(list(range(1, 8))) == [1, 3, 5, 7]  # not 1 3 4 5 7
    assert step_ticks(list(range(1, 12))) == [1, 4, 7, 11]  # 10 would crowd 11
