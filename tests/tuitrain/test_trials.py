"""Trials: one row per setting a run has used, timed on its settled steps, the best marked."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.tuitrain.fakeworker import GiB, MiB, fake_stats
from tuitrain import trials as trials_module
from tuitrain.metrics import latest_run
from tuitrain.trials import (
    BEST_MIN_SETTLED,
    Setting,
    TrialBook,
    append_summary,
    best_trial,
    summary_lines,
    trials,
    trials_record,
)


def step(
    n: int,
    *,
    policy: str = "auto",
    margin_ratio: float = 0.0,
    device_budget: int = 6 * GiB,
    seconds: float = 1.0,
    tokens: int = 100,
    peak: int = 1 * GiB,
    rss: int = 2 * GiB,
    copied: tuple[int, int] = (0, 0),
    applied: tuple[str, ...] = (),
):
    stats = fake_stats(n, policy=policy, margin_ratio=margin_ratio, device_budget=device_budget)
    memory = dataclasses.replace(stats.memory, device_peak=peak, process_rss=rss)
    return dataclasses.replace(
        stats,
        seconds=seconds,
        tokens=tokens,
        memory=memory,
        bytes_h2d=copied[0],
        bytes_d2h=copied[1],
        applied=list(applied),
    )


def settled(first: int, **kw) -> list:
    """A trial's first step and BEST_MIN_SETTLED settled ones after it, enough for a star."""
    return [step(n, **kw) for n in range(first, first + BEST_MIN_SETTLED + 1)]


def test_one_row_per_setting_in_the_order_first_used_and_a_return_adds_to_its_row():
    rows = trials(
        [
            step(1),
            step(2),
            step(3, policy="cpu"),
            step(4, policy="cpu"),
            step(5),  # back to auto
            step(6),
            step(7, margin_ratio=0.5),
        ]
    )
    settings = [(t.policy, t.margin_ratio) for t in rows]
    assert settings == [("auto", 0.0), ("cpu", 0.0), ("auto", 0.5)]
    auto = rows[0]
    assert auto.steps == 4 and (auto.first_step, auto.last_step) == (1, 6)


def test_the_step_after_each_change_and_the_first_step_are_left_out_of_the_medians():
    rows = trials(
        [
            step(1, seconds=30.0),  # the warm-up: records the chunk order
            step(2, seconds=2.0),
            step(3, seconds=4.0),
            step(4, seconds=3.0),
            step(5, policy="cpu", seconds=20.0, copied=(9 * GiB, 0)),  # re-places chunks
            step(6, policy="cpu", seconds=5.0, copied=(3 * MiB, 1 * MiB)),
        ]
    )
    auto, cpu = rows
    assert auto.settled_steps == 3 and auto.step_seconds == 3.0
    assert auto.tokens_per_second == 100 / 3.0
    assert cpu.steps == 2 and cpu.settled_steps == 1 and cpu.step_seconds == 5.0
    assert cpu.bytes_copied == 4 * MiB  # h2d + d2h of the settled step


def test_a_step_at_which_the_worker_applied_a_change_is_not_settled_even_to_the_same_value():
    rows = trials([step(1), step(2, seconds=2.0), step(3, seconds=9.0, applied=("margin 0.00",))])
    assert rows[0].settled_steps == 1 and rows[0].step_seconds == 2.0


def test_a_long_trial_takes_its_medians_over_its_latest_settled_steps(monkeypatch):
    monkeypatch.setattr(trials_module, "SAMPLES_KEPT", 3)
    rows = trials([step(1), *(step(n, seconds=9.0) for n in (2, 3, 4)), step(5), step(6)])
    assert rows[0].settled_steps == 5 and rows[0].step_seconds == 1.0


def test_a_setting_with_only_its_first_step_has_no_pace_yet():
    (only,) = trials([step(1)])
    assert only.step_seconds is None and only.tokens_per_second is None
    assert only.bytes_copied is None
    assert "no settled step yet" in only.describe()
    assert best_trial([only]) is None


def test_a_trial_is_starred_only_once_it_has_enough_settled_steps():
    few = [step(1), *(step(n, seconds=0.5) for n in range(2, BEST_MIN_SETTLED + 1))]
    many = [step(n, policy="cpu", seconds=1.0) for n in range(10, 30)]
    rows = trials(few + many)
    assert rows[0].settled_steps == BEST_MIN_SETTLED - 1  # faster, but on too few steps
    assert best_trial(rows).setting == Setting("cpu", 0.0, 6 * GiB)
    rows = trials([*few, step(BEST_MIN_SETTLED + 1, seconds=0.5), *many])
    assert best_trial(rows).setting == Setting("auto", 0.0, 6 * GiB)


def test_a_trial_shows_its_spread_in_the_words_every_place_uses():
    times = [9.0, 1.0, 1.0, 1.2, 0.8, 1.0]  # the first is not settled
    (trial,) = trials([step(n, seconds=s) for n, s in enumerate(times, start=1)])
    assert trial.step_seconds == 1.0 and trial.step_seconds_spread == pytest.approx(0.0)
    (trial,) = trials([step(n, seconds=s) for n, s in enumerate([9, 1, 2, 3, 4, 5], start=1)])
    assert trial.step_seconds == 3.0 and trial.step_seconds_spread == pytest.approx(1 / 3)
    assert "3.00 s/step, 33 tok/s (median of 5 settled steps, ±33%)" in trial.describe()


def test_tokens_a_second_are_those_of_the_median_step_for_an_even_count_too():
    """ms/step and tok/s are one figure: a median of rates over an even count of steps
    would be the mean of two other steps' (0.34 s/step beside 2,856 tok/s, not 752)."""
    times = [9.0, 0.1, 0.2, 0.5, 0.6]  # the first is not settled: 4 settled steps
    (trial,) = trials([step(n, seconds=s) for n, s in enumerate(times, start=1)])
    assert trial.step_seconds == pytest.approx(0.35)
    assert trial.tokens_per_second == pytest.approx(100 / 0.35)


def test_peaks_are_the_highest_of_all_the_steps_and_one_step_over_the_budget_counts():
    rows = trials(
        [
            step(1, device_budget=3 * GiB, peak=2 * GiB, rss=5 * GiB),
            step(2, device_budget=3 * GiB, peak=int(3.5 * GiB), rss=4 * GiB),
            step(3, device_budget=3 * GiB, peak=2 * GiB, rss=4 * GiB),
        ]
    )
    (trial,) = rows
    assert trial.device_peak == int(3.5 * GiB) and trial.process_rss == 5 * GiB
    assert not trial.within_budget
    assert "(over budget)" in trial.describe()


def test_the_best_is_the_fastest_that_stayed_within_its_budget():
    rows = trials(
        [
            *settled(1, policy="cuda", device_budget=3 * GiB, seconds=0.5, peak=8 * GiB),
            *settled(11, policy="cpu", device_budget=3 * GiB, seconds=2.0),
            *settled(21, policy="auto", device_budget=3 * GiB, seconds=1.5),
        ]
    )  # cuda is the fastest, over its budget
    assert best_trial(rows).setting == Setting("auto", 0.0, 3 * GiB)
    record = trials_record(rows)
    assert [r["best"] for r in record] == [False, False, True]
    assert record[0]["within_budget"] is False and record[2]["step_seconds"] == 1.5
    json.dumps(record)  # plain data


def test_the_book_folds_steps_as_they_come_and_forgets_them_on_reset():
    book = TrialBook()
    book.record(step(1))
    book.record(step(2, policy="cpu"))
    assert book.current == Setting("cpu", 0.0, 6 * GiB)
    assert len(book.rows()) == 2
    book.reset()
    assert book.rows() == [] and book.current is None


def test_a_trial_measures_what_a_preset_header_records():
    (trial,) = trials([step(4), step(5, seconds=2.0), step(6, seconds=2.0)])
    assert trial.measured() == {
        "first_step": 4,
        "settled_steps": 2,
        "step": 6,
        "device_peak": 1 * GiB,
        "step_seconds": 2.0,
        "tokens_per_second": 50.0,
        "bytes_copied_per_step": 0,
        "process_rss": 2 * GiB,
        "within_budget": True,
    }


# --- the headless summary -----------------------------------------------------------------


def test_summary_lines_mark_the_best():
    rows = trials([*settled(1), step(20, policy="cpu"), step(21, policy="cpu", seconds=3.0)])
    lines = summary_lines(rows)
    assert lines[0].startswith("  trials")
    assert lines[1].startswith(
        f"    ★ auto, margin 0.00, budget 6.0 GiB: {BEST_MIN_SETTLED + 1} steps, 1.00 s/step"
    )
    assert lines[2].startswith("      cpu, margin 0.00")
    assert summary_lines([]) == []


def test_the_summary_line_appended_to_the_metrics_is_skipped_by_step_readers(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({"settings": {}}) + "\n" + json.dumps({"step": 1}) + "\n")
    append_summary(path, {"steps": 1}, trials(settled(1)))
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["summary"]["steps"] == 1
    assert last["summary"]["trials"][0]["policy"] == "auto"
    assert last["summary"]["trials"][0]["best"] is True
    assert latest_run(path) == [{"step": 1}]
