"""The tuner's search on a fake clock and a scripted engine: what it tries, in what order,
when it stops early or altogether, and what it keeps."""

from __future__ import annotations

import io
import json
import statistics

import pytest

from tuitrain.tune import (
    Candidate,
    Ended,
    Failed,
    Forecast,
    Refused,
    StepResult,
    candidates,
    search,
)
from tuitrain.tune_main import TrialReports

GIB = 2**30


def cand(policy: str, margin: float = 0.0, micro: int = 8, accum: int = 1,
         ckpt: bool = False) -> Candidate:
    return Candidate(policy, margin, micro, accum, ckpt, GIB)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedEngine:
    """Steps take the seconds the script gives the applied setting, on the fake clock; the
    first step after a change re-traces (counted slow) when `retrace` says so."""

    def __init__(self, clock: FakeClock, seconds: dict[Candidate, float], *,
                 refuse: dict[Candidate, str] | None = None,
                 fail: dict[Candidate, str] | None = None, retrace: bool = False) -> None:
        self.clock, self.seconds = clock, seconds
        self.refuse, self.fail = refuse or {}, fail or {}
        self.retrace = retrace
        self.current: Candidate | None = None
        self.applied: list[Candidate] = []
        self.steps = 0
        self.fresh = False

    def apply(self, candidate: Candidate) -> None:
        if candidate in self.refuse:
            raise Refused(self.refuse[candidate])
        self.current = candidate
        self.applied.append(candidate)
        self.fresh = True

    def step(self) -> StepResult:
        self.steps += 1
        if self.current in self.fail:
            raise Failed(self.fail[self.current])
        seconds = self.seconds[self.current]
        retraced = self.retrace and self.fresh
        if self.fresh:
            seconds *= 3  # the step after a change: a re-trace, allocations
            self.fresh = False
        self.clock.now += seconds
        return StepResult(seconds, retraced=retraced)


def forecaster(table: dict[Candidate, float], misfits: dict[Candidate, str] | None = None):
    misfits = misfits or {}

    def forecast(c: Candidate) -> Forecast:
        if c in misfits:
            return Forecast(False, 0.0, misfits[c])
        return Forecast(True, table[c])

    return forecast


A, B, C, D = cand("cuda"), cand("auto", 0.5), cand("auto"), cand("cpu")


def test_the_space_keeps_the_global_batch_and_gives_cuda_no_margins():
    space = candidates(global_batch=8, device_budgets=[GIB, 2 * GIB])
    assert all(c.batch_size * c.grad_accum == 8 for c in space)
    assert {(c.batch_size, c.grad_accum) for c in space} == {(8, 1), (4, 2), (2, 4), (1, 8)}
    assert {c.margin_ratio for c in space if c.policy == "cuda"} == {0.0}
    # per budget: (cuda 1 + auto 3 + cpu 3 margins) x 4 splits x 2 checkpointing
    assert len(space) == 2 * 7 * 4 * 2
    assert space[0].settings() == {
        "engine": {"policy": "cuda", "margin_ratio": 0.0, "device_budget": GIB},
        "training": {"batch_size": 8, "grad_accum": 1, "activation_checkpointing": False}}


def test_it_drops_what_does_not_fit_measures_fastest_forecast_first_and_keeps_the_best():
    clock = FakeClock()
    # The model is 20% optimistic about B, so C, forecast a little slower, is truly faster.
    engine = ScriptedEngine(clock, {B: 1.2, C: 1.1, D: 2.0})
    result = search([A, B, C, D],
                    forecaster({B: 1.0, C: 1.05, D: 1.9},
                               {A: "needs 3.0 GiB on the device, have 1.0 GiB"}),
                    engine, clock=clock)
    by = {t.candidate: t for t in result.trials}
    assert by[A].status == "does not fit" and "3.0 GiB" in by[A].reason
    assert A not in engine.applied  # never tried: no trial goes over a budget
    assert engine.applied[:2] == [B, C]
    assert by[B].measured == 1.2 and by[C].measured == 1.1
    assert result.best.candidate == C
    assert engine.current == C  # the best applied and kept
    # D's forecast, corrected by the model's error so far, cannot come near: not tried.
    assert by[D].status == "forecast slower" and "+" in by[D].reason
    assert result.stopped_by == "converged"
    # Each trial: one step after the change, skipped, then three settled ones.
    assert by[B].skipped == 1 and len(by[B].steps) == 3
    assert result.steps == engine.steps == 8


def test_a_kind_of_setting_not_yet_measured_keeps_the_models_whole_uncertainty():
    """Two trials of one policy agreeing with the model say nothing of its error on another:
    a cpu setting forecast 8% slower than the best auto ones is still tried, and wins."""
    clock = FakeClock()
    auto_a, auto_b = cand("auto"), cand("auto", 0.5)
    engine = ScriptedEngine(clock, {auto_a: 1.0, auto_b: 1.01, D: 0.9})
    result = search([auto_a, auto_b, D], forecaster({auto_a: 1.0, auto_b: 1.01, D: 1.08}),
                    engine, clock=clock)
    assert engine.applied[:3] == [auto_a, auto_b, D]
    assert result.best.candidate == D and engine.current == D


def test_the_next_trial_is_the_most_promising_once_the_models_error_is_known():
    """The model is right about auto and 30% pessimistic about cpu: corrected kind by kind,
    the second cpu setting, forecast last, is more promising than the second auto one, and
    is tried (it wins); corrected as one, both looked no better than the best."""
    clock = FakeClock()
    auto_a, cpu_a, auto_b, cpu_b = cand("auto"), cand("cpu"), cand("auto", 0.5), cand("cpu", 0.5)
    engine = ScriptedEngine(clock, {auto_a: 1.0, cpu_a: 0.707, auto_b: 1.02, cpu_b: 0.65})
    result = search([auto_a, cpu_a, auto_b, cpu_b],
                    forecaster({auto_a: 1.0, cpu_a: 1.01, auto_b: 1.015, cpu_b: 1.02}),
                    engine, clock=clock)
    assert engine.applied[:3] == [auto_a, cpu_a, cpu_b]
    by = {t.candidate: t for t in result.trials}
    assert result.best.candidate == cpu_b and engine.current == cpu_b
    assert by[auto_b].status == "forecast slower"


def test_a_retraced_step_is_not_measured():
    clock = FakeClock()
    engine = ScriptedEngine(clock, {B: 1.0}, retrace=True)
    result = search([B], forecaster({B: 1.0}), engine, clock=clock)
    assert result.trials[0].steps == [1.0, 1.0, 1.0]


def test_a_clearly_slower_trial_stops_early():
    clock = FakeClock()
    engine = ScriptedEngine(clock, {B: 1.0, C: 3.0})
    # The model thinks C is as fast as B: it must be measured, and is cut short.
    result = search([B, C], forecaster({B: 1.0, C: 1.0}), engine, clock=clock, trial_steps=5)
    by = {t.candidate: t for t in result.trials}
    assert by[C].status == "stopped early" and len(by[C].steps) == 1
    assert by[C].reason == "200% slower than the best after 1 step"
    assert result.best.candidate == B and engine.current == B


def test_a_refused_and_a_failed_setting_are_recorded_and_the_search_goes_on():
    clock = FakeClock()
    engine = ScriptedEngine(clock, {B: 1.0, C: 1.0, D: 1.5},
                            refuse={B: "margin 0.5 leaves no room"},
                            fail={C: "worker died"})
    result = search([B, C, D], forecaster({B: 1.0, C: 1.1, D: 1.2}), engine, clock=clock)
    by = {t.candidate: t for t in result.trials}
    assert (by[B].status, by[B].reason) == ("refused", "margin 0.5 leaves no room")
    assert (by[C].status, by[C].reason) == ("failed", "worker died")
    assert by[D].status == "measured" and result.best.candidate == D
    assert engine.current == D


def test_the_time_limit_ends_the_search_with_the_best_so_far():
    clock = FakeClock()
    space = [cand("auto", m / 10) for m in range(6)]
    engine = ScriptedEngine(clock, dict.fromkeys(space, 1.0))
    # Forecasts all alike: the model cannot rule any out, only time can.
    result = search(space, forecaster(dict.fromkeys(space, 1.0)), engine, clock=clock,
                    time_limit=10.0)
    statuses = [t.status for t in result.trials]
    # 6 s per trial (a 3 s step after the change, three of 1 s): two fit in 10 s.
    assert statuses == ["measured"] * 2 + ["not tried"] * 4
    assert result.stopped_by == "time limit"
    assert all(t.reason == "time limit" for t in result.trials[2:])
    assert result.best is not None and engine.current == result.best.candidate


def test_the_stop_key_ends_the_search_at_once_keeping_the_best():
    clock = FakeClock()
    engine = ScriptedEngine(clock, {B: 1.0, C: 0.9, D: 0.8})
    asked = []

    def stop() -> bool:
        asked.append(engine.steps)
        return engine.steps >= 6  # pressed during C's trial

    result = search([B, C, D], forecaster({B: 1.0, C: 1.0, D: 1.0}), engine, clock=clock,
                    stop=stop)
    by = {t.candidate: t for t in result.trials}
    assert by[B].status == "measured"
    assert by[C].status == "not tried" and "stopped after 1 of 3 steps" in by[C].reason
    assert by[D].status == "not tried" and by[D].reason == "stopped"
    assert result.stopped_by == "stopped" and result.best.candidate == B
    assert engine.current == B  # C was half-tried: the best goes back in


def test_every_trial_change_is_told():
    clock = FakeClock()
    seen = []
    search([A, B], forecaster({B: 1.0}, {A: "too big"}), ScriptedEngine(clock, {B: 1.0}),
           clock=clock, on_trial=lambda t: seen.append((t.candidate.policy, t.status)))
    assert seen[0] == ("cuda", "does not fit")
    assert ("auto", "measuring") in seen and seen[-1] == ("auto", "measured")


class EndingEngine(ScriptedEngine):
    """A run of `last` steps: a step past it, or a change asked for after it, is Ended."""

    def __init__(self, clock: FakeClock, seconds: dict[Candidate, float], *, last: int) -> None:
        super().__init__(clock, seconds)
        self.last = last

    def apply(self, candidate: Candidate) -> None:
        if self.steps >= self.last:
            raise Ended("the run ended")
        super().apply(candidate)

    def step(self) -> StepResult:
        if self.steps >= self.last:
            raise Ended("the run made its last step")
        return super().step()


@pytest.mark.parametrize("keep_best", [True, False])
def test_a_run_of_few_steps_ends_the_search_when_no_trial_fits_in_what_is_left(keep_best):
    """A trial takes four steps here (the one after the change, three settled): two fit in
    a run of 11, a third does not begin. The best goes back in for the steps left when the
    run goes on after the search (keep_best), not when the run ends with it."""
    clock = FakeClock()
    engine = ScriptedEngine(clock, {B: 0.9, C: 1.0, D: 1.1})
    result = search([B, C, D], forecaster({B: 1.0, C: 1.0, D: 1.0}), engine, clock=clock,
                    steps_left=lambda: 11 - engine.steps, keep_best=keep_best)
    by = {t.candidate: t for t in result.trials}
    assert [by[c].status for c in (B, C, D)] == ["measured", "measured", "not tried"]
    assert by[D].reason == "step limit" and result.stopped_by == "step limit"
    assert result.best.candidate == B
    assert result.steps == engine.steps == 8
    assert engine.current == (B if keep_best else C)


def test_a_run_that_ends_under_a_trial_ends_the_search_with_the_best_so_far():
    """The run's last step comes during C's trial: C is left unfinished, not failed, D is
    not tried, and no change is asked of a run that has ended."""
    clock = FakeClock()
    engine = EndingEngine(clock, {B: 1.0, C: 0.9, D: 0.8}, last=6)
    result = search([B, C, D], forecaster({B: 1.0, C: 1.0, D: 1.0}), engine, clock=clock)
    by = {t.candidate: t for t in result.trials}
    assert by[B].status == "measured"
    assert (by[C].status, by[C].reason) == ("not tried", "the run ended after 1 of 3 steps")
    assert (by[D].status, by[D].reason) == ("not tried", "step limit")
    assert result.stopped_by == "step limit" and result.best.candidate == B
    assert result.steps == engine.steps == 6
    assert engine.applied == [B, C]


def test_a_run_that_ends_while_trials_are_measured_again_keeps_what_they_measured():
    """A and B are too close to tell: B, in force, is measured again first, and the run
    ends after two more of its steps; A, the faster on what was measured, is the best, but
    the run has no step left to apply it."""
    clock = FakeClock()
    engine = EndingEngine(clock, {A: 1.0, B: 1.02}, last=10)
    result = search([A, B], forecaster({A: 1.0, B: 1.02}), engine, clock=clock)
    by = {t.candidate: t for t in result.trials}
    assert len(by[A].steps) == 3 and len(by[B].steps) == 5
    assert by[B].status == "measured" and by[B].measured == 1.02
    assert result.best.candidate == A and engine.current == B
    assert result.steps == engine.steps == 10
    assert result.log[-1] == "the run ended before the best could be applied"


@pytest.mark.parametrize("steps", [1, 3])
def test_a_trial_takes_at_least_three_settled_steps(steps):
    clock = FakeClock()
    result = search([B], forecaster({B: 1.0}), ScriptedEngine(clock, {B: 1.0}), clock=clock,
                    trial_steps=steps)
    assert len(result.trials[0].steps) == 3


def test_the_plan_forecasts_each_candidate_and_says_why_one_does_not_fit():
    from tests.calibrations import fixed_calibration
    from tuitrain.tune_plan import plan_forecaster

    forecast = plan_forecaster("tiny", host_mem=16 * GIB, precision="fp32", seq_len=32,
                               simulated=True, calibration=fixed_calibration())
    small = 20 * 2**20
    too_small = forecast(Candidate("cuda", 0.0, 4, 1, False, small))
    assert not too_small.fits and "have 20.0 MiB" in too_small.reason
    assert too_small.over.startswith("device +") and too_small.over.endswith(" MiB")
    whole, split = (forecast(Candidate("cpu", 0.0, micro, 4 // micro, False, small))
                    for micro in (4, 2))
    assert whole.fits and split.fits and whole.seconds > 0
    # Two micro-batches fetch every chunk twice: more copies for the same global batch.
    assert split.seconds > whole.seconds


def test_the_forecast_plans_each_candidates_accumulation(tmp_path):
    """Later micro-batches read from disk what the first sent there: a candidate's
    forecast is its plan at its own accumulation, not one micro-batch's."""
    from engine.planning.planner import plan
    from engine.planning.time_model import step_times
    from tests.calibrations import fixed_calibration
    from tuitrain.tune_plan import plan_forecaster

    shape = dict(host_mem=16 * GIB, precision="fp32", seq_len=32, simulated=True)
    half = plan("tiny", device_mem=GIB, batch_size=2, **shape).model_bytes // 2
    forecast = plan_forecaster("tiny", calibration=fixed_calibration(), disk_dir=tmp_path,
                               **shape)
    for accum in (1, 4):
        c = Candidate("cpu", 0.0, 2, accum, False, GIB, host_budget=half)
        p = plan("tiny", device_mem=GIB, batch_size=2, host_budget=half, disk_dir=tmp_path,
                 grad_accum=accum, **shape)
        assert p.cpu.disk_later_read > 0 if accum > 1 else p.cpu.disk_later_read == 0
        expected = step_times(p, fixed_calibration(), grad_accum=accum)["cpu"].total
        assert forecast(c).seconds == pytest.approx(expected)


def test_a_setting_on_the_disk_is_forecast_at_the_disks_speed_now(tmp_path, monkeypatch):
    """Its folder's disk is probed once, when the first setting that uses it is forecast
    (engine.planning.disk_speed), and the user is told; settings without the disk do not
    wait for it."""
    import dataclasses

    from engine.planning import disk_speed
    from engine.planning.planner import plan
    from engine.planning.time_model import step_times
    from tests.calibrations import fixed_calibration
    from tuitrain.tune_plan import plan_forecaster

    probed, said = [], []
    monkeypatch.setattr(disk_speed, "probe", lambda scale=1.0, base=None: (
        probed.append(base) or (0.4e9, 0.6e9, 0.3e9)))
    monkeypatch.setattr(disk_speed, "_probed", {})
    shape = dict(host_mem=16 * GIB, precision="fp32", seq_len=32, simulated=True)
    half = plan("tiny", device_mem=GIB, batch_size=2, **shape).model_bytes // 2
    forecast = plan_forecaster("tiny", calibration=fixed_calibration(), disk_dir=tmp_path,
                               say=said.append, **shape)
    assert forecast(Candidate("cpu", 0.0, 2, 1, False, GIB)).fits and probed == []
    on_disk = [Candidate(policy, 0.0, 2, 1, False, GIB, host_budget=half)
               for policy in ("cpu", "auto")]
    p = plan("tiny", device_mem=GIB, batch_size=2, host_budget=half, disk_dir=tmp_path,
             **shape)
    now = dataclasses.replace(fixed_calibration(), disk_write=0.4e9, disk_read=0.6e9,
                              disk_duplex=0.3e9)
    for c in on_disk:
        assert forecast(c).seconds == pytest.approx(step_times(p, now)[c.policy].total)
    assert probed == [tmp_path] and len(said) == 1 and "measuring the disk" in said[0]


def test_the_measured_steps_teach_this_machines_next_forecast():
    from engine.planning.calibration import calibration, load_calibration
    from tuitrain.tune_setup import learn_from

    cal = calibration()  # the tests' fixed one
    a, b = cand("auto"), cand("cpu")
    clock = FakeClock()
    result = search([a, b], forecaster({a: 1.0, b: 2.0}),
                    ScriptedEngine(clock, {a: 1.5, b: 3.0}), clock=clock)
    line = learn_from(result, cal)
    assert line is not None and "1.50x their forecast" in line and "x1.50" in line
    assert load_calibration().correction == pytest.approx(1.5)
    nothing = search([a], forecaster({}, {a: "needs more"}), ScriptedEngine(clock, {}),
                     clock=clock)
    assert learn_from(nothing, load_calibration()) is None  # nothing measured, nothing taught


class NoisyEngine(ScriptedEngine):
    """Each setting's settled steps take the seconds of its list in turn (the step after a
    change is slow, as in ScriptedEngine, and takes none of them)."""

    def __init__(self, clock: FakeClock, seconds: dict[Candidate, list[float]]) -> None:
        super().__init__(clock, {c: s[0] for c, s in seconds.items()})
        self.lists = {c: iter(s) for c, s in seconds.items()}

    def step(self) -> StepResult:
        if not self.fresh:
            self.seconds[self.current] = next(self.lists[self.current])
        return super().step()


def test_trials_closer_than_their_own_noise_are_measured_again_and_all_their_steps_decide():
    """A's first three steps happened to be quick (their median 1.00 with 8% of spread)
    against B's steady 1.03: one trial each cannot tell them apart, so both are measured
    again, and on six steps each B, truly faster, is kept."""
    clock = FakeClock()
    a_steps = [1.00, 1.08, 0.92, 1.10, 1.12, 1.09]
    engine = NoisyEngine(clock, {A: a_steps, B: [1.03] * 6, D: [2.0] * 6})
    result = search([A, B, D], forecaster({A: 1.0, B: 1.02, D: 1.9}), engine, clock=clock)
    by = {t.candidate: t for t in result.trials}
    # B, the setting the run has when the search ends, is measured again first, with no
    # change and so no step skipped; then A, then B is applied again and kept.
    assert engine.applied == [A, B, A, B]
    assert by[A].steps == a_steps and by[B].steps == [1.03] * 6
    assert by[A].skipped == 2 and by[B].skipped == 1
    assert by[A].measured == pytest.approx(1.085) and by[B].measured == 1.03
    assert result.best.candidate == B and engine.current == B
    assert any("too close to tell" in line for line in result.log)
    assert by[D].status == "forecast slower"  # not part of it: far from the best
    # and said against the best kept, with the model's error on all the steps measured
    # (cpu has no trial of its own kind: the median over the others), not against A's
    # first three steps (+91%).
    slower = 1.9 * statistics.median([1.085 / 1.0, 1.03 / 1.02]) / 1.03 - 1
    assert by[D].slower == pytest.approx(slower)
    assert by[D].reason == f"forecast {slower:+.0%} against the best measured" == (
        "forecast +93% against the best measured")
    assert result.steps == engine.steps == 4 + 4 + 3 + 4


def test_trials_within_enough_on_all_their_steps_keep_the_faster_forecast():
    """Two searches of the same run, whose noise falls either way: after the run-off B is
    1.5% faster than A on six steps each in the first and 1.5% slower in the second, less
    than a shared machine resolves. The model, which forecasts A faster, chooses: both
    keep A."""
    a_steps = [1.0, 1.02, 0.99, 1.01, 1.0, 1.0]
    kept, ratios, logs = [], [], []
    for b_steps in ([0.98, 1.06, 0.92, 1.02, 0.99, 0.97], [1.01, 1.03, 0.99, 1.04, 1.02, 1.0]):
        clock = FakeClock()
        engine = NoisyEngine(clock, {A: a_steps, B: b_steps, D: [2.0] * 6})
        result = search([A, B, D], forecaster({A: 1.0, B: 1.02, D: 1.9}), engine,
                        clock=clock)
        by = {t.candidate: t for t in result.trials}
        assert len(by[A].steps) == len(by[B].steps) == 6
        assert any("too close to tell" in line for line in result.log)
        ratios.append(by[B].measured / by[A].measured)
        kept.append(result.best.candidate)
        logs.append(" ".join(result.log))
        assert engine.current == A
    assert ratios == pytest.approx([0.985, 1.015])
    assert kept == [A, A]
    # said where the medians alone would have kept the other
    said = f"{A.describe()} within 3% of {B.describe()} on all their steps"
    assert [said in log for log in logs] == [True, False]


def test_the_records_of_a_tune_end_with_what_its_final_table_says():
    """`tuitrain tune`'s progress lines and --metrics records over the search above: a line
    and a record per candidate as it is decided, a line and an `again` record for each
    measured again, and a `revised` record (no line) for D, whose share was first said
    against A's three quick steps (+91%) and is +93% against the best kept."""
    clock = FakeClock()
    engine = NoisyEngine(clock, {A: [1.00, 1.08, 0.92, 1.10, 1.12, 1.09], B: [1.03] * 6,
                                 D: [2.0] * 6})
    out, records = io.StringIO(), []
    result = search([A, B, D], forecaster({A: 1.0, B: 1.02, D: 1.9}), engine, clock=clock,
                    on_trial=TrialReports(3, 512, out, records.append))
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "trial 1/3", "trial 2/3", "trial 3/3", "measured again", "measured again"]
    assert "+91% against the best measured" in lines[2]
    trials = [r["trial"] for r in records]
    assert [(t["settings"]["engine"]["policy"], t["status"], t.get("again"), t.get("revised"))
            for t in trials] == [
        ("cuda", "measured", None, None), ("auto", "measured", None, None),
        ("cpu", "forecast slower", None, None),
        ("auto", "measured", True, None), ("cuda", "measured", True, None),
        ("cpu", "forecast slower", None, True)]
    last = {json.dumps(t["settings"]): t for t in trials}  # each candidate's latest record
    by = {t.candidate: t for t in result.trials}
    for candidate, trial in by.items():
        record = last[json.dumps(candidate.settings())]
        assert (record["status"], record.get("reason", ""), record.get("measured_seconds")) == (
            trial.status, trial.reason, trial.measured)
    assert last[json.dumps(D.settings())]["reason"] == "forecast +93% against the best measured"
    assert last[json.dumps(B.settings())]["settled_steps"] == 6
    assert last[json.dumps(B.settings())]["tokens_per_second"] == pytest.approx(512 / 1.03)


def test_the_measuring_again_stops_at_the_time_limit_and_keeps_the_best_so_far():
    clock = FakeClock()
    engine = NoisyEngine(clock, {A: [1.00, 1.08, 0.92, 1.10, 1.12, 1.09], B: [1.03] * 6})
    # The two trials take 12.18 s of the clock (the step after each change counts thrice),
    # B's second, with no change, 3.09 s more: past the limit before A's second.
    result = search([A, B], forecaster({A: 1.0, B: 1.02}), engine, clock=clock,
                    time_limit=15.0)
    by = {t.candidate: t for t in result.trials}
    assert len(by[B].steps) == 6 and len(by[A].steps) == 3  # A not measured again
    assert result.best.candidate == A  # on what was measured: 1.00 against 1.03
    assert engine.current == A
