"""`tuitrain tune`: the search on a real run of `tiny`, its records and preset, its bad input,
and the worker as the search's trainer (scripted events)."""

from __future__ import annotations

import json

import pytest

from engine.planning.calibration import load_calibration
from tests.tuitrain.fakeworker import fake_stats
from tuitrain.cli import main
from tuitrain.events import Applied, Finished, Rejected, SetMargin, SetPolicy, SetShape, Step
from tuitrain.tune import Candidate, Ended, Failed, Refused
from tuitrain.tune_main import parse_duration
from tuitrain.tune_worker import WorkerTrainer

GIB = 2**30


# --- the real command --------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_tune_records_every_candidate_saves_the_best_and_keeps_the_losses(
        tmp_path, capsys):
    """A trial or two (the time limit passes during them) on a run that starts on cpu, in
    two checkpointed micro-batches of one sequence: a trial switches the policy and the
    split while the run trains, and every loss is the one an untuned run of the same global
    batch gets."""
    metrics, preset = tmp_path / "m.jsonl", tmp_path / "p.yaml"
    run = ["tiny", "--seq-len", "32", "--batch-size", "1", "--grad-accum", "2",
           "--checkpointing", "--policy", "cpu", "--precision", "fp32"]
    status = main(["tune", *run, "--trial-steps", "3", "--time-limit", "1s",
                   "--metrics", str(metrics), "--save-preset", str(preset)])
    out = capsys.readouterr().out
    assert status == 0, out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    trials = [r["trial"] for r in records
              if "trial" in r and not r["trial"].get("again") and not r["trial"].get("revised")]
    (tuned,) = [r["tuned"] for r in records if "tuned" in r]
    # A setting measured again beside the best has a second record: the median of all its
    # steps, which the choice goes by.
    again = {json.dumps(r["trial"]["settings"]): r["trial"] for r in records
             if r.get("trial", {}).get("again")}
    # cuda, and auto and cpu at three margins; each in 2 x 1 and 1 x 2, checkpointed or not
    assert len(trials) == 28
    # How many trials fit in the second depends on the machine: on a loaded one the limit
    # passes during the first; on a quiet one the search may end first, when the forecast
    # says no untried setting can beat the best measured. Either way every candidate is
    # accounted for, and the best measured is the one kept.
    measured = [t for t in trials if t["status"] == "measured"]
    assert 1 <= len(measured) < len(trials)
    assert tuned["stopped_by"] in ("time limit", "converged")
    rest = [t for t in trials if t not in measured]
    # What the search ruled out before it ended keeps its reason: a forecast slower than the
    # best measured, or a trial stopped once clearly slower (on a quiet machine both come
    # before the limit); only the time limit leaves candidates not tried.
    ruled_out = {"forecast slower", "stopped early"}
    if tuned["stopped_by"] == "time limit":
        assert all(t["status"] in ruled_out
                   or (t["status"] == "not tried" and t["reason"] == "time limit")
                   for t in rest), rest
    else:
        assert all(t["status"] in ruled_out for t in rest), rest
    assert all(r["settled_steps"] > 3 for r in again.values())
    assert set(again) <= {json.dumps(t["settings"]) for t in measured}
    latest = [again.get(json.dumps(t["settings"]), t) for t in measured]
    best = min(latest, key=lambda t: t["measured_seconds"])
    assert tuned["settings"] == best["settings"]
    assert tuned["settled_steps"] == best["settled_steps"]
    if not best.get("again"):
        assert best["settled_steps"] == 3
    assert set(tuned["settings"]["engine"]) >= {"policy", "margin_ratio"}
    assert out.count("\ntrial ") + out.startswith("trial ") == 28
    assert out.count("\nmeasured again: ") == len(again)
    # What the trials measured teaches the next forecast on this machine.
    assert "time model: steps took " in out
    assert load_calibration().learned_from == 1
    text = preset.read_text()
    assert "# tuned on machine: " in text and "# forecast: " in text and "# search: " in text
    assert f"policy: {tuned['settings']['engine']['policy']}" in text
    # Trials ran under other policies than the run started with, while it trained (the
    # first trial's commands may reach the worker before its first step: a run tunes from
    # step 1).
    steps = [r for r in records if "step" in r and "loss" in r]
    assert {s["policy"] for s in steps} - {"cpu"}
    # and other splits: the fastest forecast is not the slowest shape the run started in
    shapes = {(s["micro_batches"], s["activation_checkpointing"]) for s in steps}
    assert shapes - {(2, True)}, shapes
    assert set(tuned["settings"]["training"]) == {"batch_size", "grad_accum",
                                                 "activation_checkpointing"}

    plain = tmp_path / "plain.jsonl"
    assert main(["run", *run, "--headless", "--steps", str(len(steps)),
                 "--metrics", str(plain)]) == 0
    untuned = [r["loss"] for r in map(json.loads, plain.read_text().splitlines())
               if "step" in r and "loss" in r]
    assert [s["loss"] for s in steps] == pytest.approx(untuned, rel=1e-5)


def records_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tune_says_the_steps_its_run_made_and_its_metrics_end_with_the_summary(
        tmp_path, capsys):
    """Without --steps the run ends with the search: every step it made is the tune's, one
    step line each, and the count said, the `tuned` record's and the summary's are that
    many. The file ends as a headless run's does, with the run's summary."""
    metrics = tmp_path / "m.jsonl"
    status = main(["tune", "tiny", "--seq-len", "32", "--precision", "fp32", "--trial-steps",
                   "3", "--time-limit", "1s", "--metrics", str(metrics)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    records = records_of(metrics)
    steps = [r["step"] for r in records if "step" in r and "loss" in r]
    assert steps == list(range(1, len(steps) + 1))
    assert [next(iter(r)) for r in records[-2:]] == ["tuned", "summary"]
    tuned, summary = records[-2]["tuned"], records[-1]["summary"]
    assert tuned["steps"] == summary["steps"] == len(steps)
    assert f"tuned in {len(steps)} steps ({tuned['stopped_by']}): " in captured.out
    # its trials are the settings its steps ran under, as a headless run's summary has them
    assert sum(t["steps"] for t in summary["trials"]) == len(steps)
    # the step the tune's own stop cut short is no news
    assert "interrupted" not in captured.err


def test_a_tune_of_n_steps_trains_n_steps_in_all_and_the_last_with_the_best(tmp_path, capsys):
    """--steps N is the run's length, as for `tuitrain run`: the search takes its steps
    from it (ending when no trial fits in what is left) and the run goes on with the best
    to step N. The search's steps said are the first step lines; the rest ran with the
    best."""
    metrics = tmp_path / "m.jsonl"
    status = main(["tune", "tiny", "--seq-len", "32", "--precision", "fp32", "--trial-steps",
                   "3", "--steps", "14", "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert status == 0, out
    records = records_of(metrics)
    steps = [r for r in records if "step" in r and "loss" in r]
    assert [s["step"] for s in steps] == list(range(1, 15))
    (tuned,) = [r["tuned"] for r in records if "tuned" in r]
    summary = records[-1]["summary"]
    assert (summary["steps"], summary["planned_steps"], summary["stopped"]) == (14, 14, False)
    searched = tuned["steps"]
    assert f"tuned in {searched} steps ({tuned['stopped_by']}): " in out
    assert any(r["trial"]["status"] == "measured" for r in records if "trial" in r)
    best = tuned["settings"]
    with_best = (best["engine"]["policy"], best["engine"]["margin_ratio"],
                 best["training"]["grad_accum"], best["training"]["activation_checkpointing"])
    after = steps[searched:]
    assert [(s["policy"], s["margin_ratio"], s["micro_batches"], s["activation_checkpointing"])
            for s in after] == [with_best] * len(after)
    if after:
        assert f"done: 14 steps, the last {len(after)} with it" in out
    # what the search had no steps left for says so
    not_tried = [r["trial"]["reason"] for r in records
                 if r.get("trial", {}).get("status") == "not tried"]
    assert all(reason == "step limit" or reason.startswith("the run ended after ")
               for reason in not_tried), not_tried


@pytest.mark.parametrize(("flags", "least"), [(["--steps", "4"], 5),
                                              (["--steps", "6", "--trial-steps", "5"], 7)])
def test_steps_too_few_for_one_trial_are_refused_in_one_line(flags, least, capsys):
    assert main(["tune", "tiny", *flags]) == 2
    trial_steps = flags[-1] if "--trial-steps" in flags else "3"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"tuitrain: error: --steps: a tune measures a setting in {least} steps at the least "
        f"(--trial-steps {trial_steps}, the step under way when it is applied and the one "
        f"after; got {flags[1]})"]


@pytest.mark.parametrize(("flags", "line"), [
    (["--trial-steps", "0"], "tuitrain: error: --trial-steps: must be at least 3 (got 0)"),
    (["--trial-steps", "1"], "tuitrain: error: --trial-steps: must be at least 3 (got 1)"),
    (["--trial-steps", "2"], "tuitrain: error: --trial-steps: must be at least 3 (got 2)"),
    (["--time-limit", "soon"], "tuitrain: error: --time-limit: 'soon' is not a duration "
                               "(e.g. 90s, 5m, 1h)"),
])
def test_bad_input_is_one_line_and_status_2(flags, line, capsys):
    assert main(["tune", "tiny", *flags]) == 2
    assert capsys.readouterr().err.strip() == line


def test_a_tune_with_nothing_that_fits_says_why_before_it_starts(capsys):
    assert main(["tune", "tiny", "--device-mem", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tuitrain: error: no setting of tiny fits: ")


def test_a_global_batch_too_big_for_the_device_in_one_micro_batch_is_tuned_not_refused(
        tmp_path, capsys):
    """At 12 MiB only tiny's 1 x 8 split of a batch of 8 fits: the run starts there (the
    fastest forecast that fits), says so, and the search goes on from it."""
    metrics = tmp_path / "m.jsonl"
    status = main(["tune", "tiny", "--batch-size", "8", "--seq-len", "64", "--precision",
                   "fp32", "--device-mem", "12MiB", "--trial-steps", "3", "--time-limit",
                   "1s", "--metrics", str(metrics)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    (line,) = captured.err.splitlines()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Which policy that is, the forecast says (auto and cpu are within a few percent here).
    fits = [r["trial"] for r in records if r.get("trial", {}).get("forecast_seconds")]
    fastest = min(fits, key=lambda t: t["forecast_seconds"])["settings"]
    assert fastest["training"] == {"batch_size": 1, "grad_accum": 8,
                                   "activation_checkpointing": False}
    start = fastest["engine"]
    assert line == (f"8 x 1 does not fit; the run starts at {start['policy']} margin "
                    f"{start['margin_ratio']:.2f}, 1 x 8, the fastest forecast that fits")
    steps = [r for r in records if "step" in r and "loss" in r]
    assert steps and steps[0]["micro_batches"] == 8
    assert any(r["trial"]["status"] == "measured" for r in records if "trial" in r)


@pytest.mark.parametrize(("text", "seconds"),
                         [("90", 90), ("90s", 90), ("5m", 300), ("1m30s", 90), ("1h", 3600),
                          ("0.5s", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "5x", "0s", "-1"])
def test_what_is_not_a_duration(text):
    with pytest.raises(ValueError):
        parse_duration(text)


# --- the worker as the trainer -----------------------------------------------------------


class Scripted:
    """A worker that answers each command as `answers` says and then gives `steps`."""

    def __init__(self, steps: list[Step], answers: dict[type, object]) -> None:
        self.sent: list[object] = []
        self.queue: list[object] = []
        self.steps = steps
        self.answers = answers

    def send(self, command) -> int:
        command_id = len(self.sent)
        self.sent.append(command)
        answer = self.answers[type(command)]
        self.queue.append(Rejected(command_id, answer) if isinstance(answer, str)
                          else Applied(command_id, answer))
        return command_id

    def events(self) -> list[object]:
        if self.queue:
            out, self.queue = self.queue, []
            return out
        return [self.steps.pop(0)] if self.steps else [Finished({})]


def step(n: int, seconds: float) -> Step:
    stats = fake_stats(step=n)
    stats.seconds = seconds
    return Step(stats)


def trainer(worker: Scripted, **run) -> WorkerTrainer:
    settings = {"batch_size": 2, "grad_accum": 1, "checkpointing": False, "policy": "cpu",
                "margin_ratio": 0.0, "device_budget": GIB} | run
    return WorkerTrainer(worker.send, worker.events, **settings)


def test_a_setting_goes_as_commands_and_its_steps_start_where_it_was_applied():
    worker = Scripted([step(3, 9.0), step(4, 1.0), step(5, 2.0)],
                      {SetPolicy: 4, SetMargin: 4})
    t = trainer(worker)
    t.apply(Candidate("cuda", 0.5, 2, 1, False, GIB))
    assert [type(c) for c in worker.sent] == [SetMargin, SetPolicy]
    assert [t.step().seconds, t.step().seconds] == [1.0, 2.0]  # step 3 ran before the change
    t.apply(Candidate("cuda", 0.5, 2, 1, False, GIB))  # already so: nothing sent
    assert len(worker.sent) == 2
    with pytest.raises(Failed, match="ended"):
        t.step()


def test_steps_the_run_made_while_a_change_waited_are_counted_with_the_trials():
    worker = Scripted([step(3, 9.0), step(4, 1.0)], {SetPolicy: 4, SetMargin: 4})
    t = trainer(worker)
    t.apply(Candidate("cuda", 0.5, 2, 1, False, GIB))
    result = t.step()
    assert (result.seconds, result.earlier) == (1.0, 1)  # step 3 ran before the change


def test_a_run_of_known_length_says_what_is_left_and_ends_the_search_at_its_last_step():
    worker = Scripted([step(1, 1.0), step(2, 1.0), step(3, 1.0)],
                      {SetPolicy: 1, SetMargin: 1})
    t = trainer(worker, last_step=3)
    best = Candidate("cuda", 0.5, 2, 1, False, GIB)
    assert t.steps_left() == 2  # the first step may be under way: a change waits for it
    t.apply(best)
    assert t.step().seconds == 1.0 and t.steps_left() == 1
    assert t.holds(best) and t.free_from == 2
    t.step(), t.step()
    assert t.steps_left() == 0 and t.free_from == 4
    with pytest.raises(Ended):
        t.step()
    # a change the run could only refuse, having made its last step
    worker.answers[SetPolicy] = "training has finished"
    with pytest.raises(Ended):
        t.apply(Candidate("cpu", 0.5, 2, 1, False, GIB))


def test_a_run_that_finishes_ends_the_trial_as_the_run_s_end_not_as_a_failure():
    t = trainer(Scripted([], {}))
    with pytest.raises(Ended, match="ended"):
        t.step()
    assert t.steps_left() == 0


def test_a_refused_command_refuses_the_setting():
    worker = Scripted([], {SetPolicy: "not enough memory", SetMargin: 1})
    t = trainer(worker)
    with pytest.raises(Refused, match="not enough memory"):
        t.apply(Candidate("cuda", 0.0, 2, 1, False, GIB))


def test_a_change_of_shape_goes_first_as_set_shape_and_a_refused_one_is_sent_again():
    """The worker checks what comes after a new shape with that shape (not against a trace
    of the old one), and takes them all back if its first step overruns."""
    worker = Scripted([step(5, 1.0)], {SetShape: "micro-batches of 1 do not fit",
                                       SetPolicy: 5})
    t = trainer(worker)
    with pytest.raises(Refused, match="micro-batches of 1 do not fit"):
        t.apply(Candidate("auto", 0.0, 1, 2, True, GIB))
    assert worker.sent == [SetShape(batch_size=1, grad_accum=2, activation_checkpointing=True),
                           SetPolicy(policy="auto")]
    worker.answers[SetShape] = 5
    t.apply(Candidate("auto", 0.0, 1, 2, True, GIB))  # the policy is in force: not sent again
    assert worker.sent[2:] == [SetShape(batch_size=1, grad_accum=2,
                                        activation_checkpointing=True)]
    assert t.step().seconds == 1.0
    t.apply(Candidate("auto", 0.0, 1, 2, True, GIB))  # all in force: nothing sent
    assert len(worker.sent) == 3


def test_the_commands_of_one_setting_all_go_before_any_step_runs():
    """Margin and policy sent one answer apart let a step run under the new margin and the
    old policy: a setting nobody asked for, a row of its own in the trials table."""
    worker = Scripted([step(4, 1.0), step(5, 1.0)], {SetPolicy: 4, SetMargin: 4})
    sent_before_answers = []
    events = worker.events

    def answered() -> list[object]:
        sent_before_answers.append(len(worker.sent))
        return events()

    t = WorkerTrainer(worker.send, answered, batch_size=2, grad_accum=1, checkpointing=False,
                      policy="cpu", margin_ratio=0.0, device_budget=GIB)
    t.apply(Candidate("cuda", 0.5, 2, 1, False, GIB))
    assert sent_before_answers[0] == 2  # both commands out before the first answer is read


def test_a_resumed_run_counts_its_steps_left_from_its_checkpoint_before_it_reports_one():
    """The search asks what is left before the run's first step comes: a run resumed after
    step 196 of 200 has 3 after the one under way, not 199."""
    t = trainer(Scripted([step(197, 1.0)], {}), last_step=200, after=196)
    assert t.steps_left() == 3
    assert t.free_from == 197
