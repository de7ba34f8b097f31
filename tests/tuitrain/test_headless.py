"""The headless runner: exit statuses, what it prints, the metrics file, and Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.tuitrain.forked_workers import worker_processes
from tuitrain.headless import _Report, run_headless
from tuitrain.settings import Settings

START_SECONDS = 240.0  # a cold start imports torch and tokenises the corpus

pytestmark = pytest.mark.slow  # real worker processes: seconds to start each


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def tiny_settings(**sections: dict) -> Settings:
    # The policy chosen: one left unset would be the plan's choice (cuda, for tiny).
    engine = {"precision": "fp32", "policy": "auto", **sections.pop("engine", {})}
    training = {"batch_size": 2, "seq_len": 16, **sections.pop("training", {})}
    return Settings(model="tiny", engine=engine, training=training, **sections)


def test_a_run_prints_settings_progress_and_summary_and_appends_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    earlier = json.dumps({"settings": {"model": "an earlier run"}})
    metrics.write_text(earlier + "\n")
    out, err = Terminal(), io.StringIO()
    # The budget given, not the default, which shrinks on a machine short of memory.
    settings = tiny_settings(training={"steps": 6}, logging={"metrics": str(metrics)},
                             engine={"device_budget": "6GiB"})

    assert run_headless(settings, out=out, err=err, log_path=str(tmp_path / "w.log")) == 0

    assert err.getvalue() == ""
    text = out.getvalue()
    assert "tiny: " in text and "simulated, 6.0 GiB" in text
    assert "policy auto, margin 0.00, budget 6GiB, precision fp32" in text
    assert "6 steps of 2 x 16 tokens" in text
    assert re.search(r"\r\[#+\] step 6/6  loss \d+\.\d{4}", text), "a bar redrawn in place"
    assert "done: 6 steps, 192 tokens" in text
    # The one trial, starred: its 5 settled steps (the first records the chunk order) are
    # enough to call it the fastest (trials.BEST_MIN_SETTLED).
    assert "★ auto, margin 0.00, budget 6.0 GiB: 6 steps" in text
    assert f"metrics  {metrics}" in text

    lines = metrics.read_text().splitlines()
    assert lines[0] == earlier, "an existing metrics file is appended to, never truncated"
    records = [json.loads(line) for line in lines[1:]]
    assert len(records) == 1 + 6 + 1
    assert records[0]["settings"]["training"]["steps"] == 6
    assert [r["step"] for r in records[1:-1]] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens"] == 32 and r["policy"] == "auto" for r in records[1:-1])
    summary = records[-1]["summary"]
    assert summary["steps"] == 6
    assert [(t["policy"], t["steps"], t["best"]) for t in summary["trials"]] == [("auto", 6, True)]
    # One host peak, the steps' (as the trials have it), and no pace beside the trials'.
    steps = records[1:-1]
    assert summary["peak_host_bytes"] == max(r["memory"]["process_rss"] for r in steps)
    assert summary["peak_host_bytes"] == summary["trials"][0]["process_rss"]
    assert not {"mean_step_seconds", "tokens_per_second"} & set(summary)


def test_a_budget_below_the_working_set_exits_2_with_one_line(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    settings = tiny_settings(engine={"device_budget": "64KiB"}, training={"steps": 3})

    assert run_headless(settings, out=out, err=err, log_path=str(tmp_path / "w.log")) == 2

    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tuitrain: error: device budget 64.0 KiB is below the minimum")
    assert out.getvalue() == "", "no `starting tiny (worker log ...)` before the refusal"


def test_ctrl_c_stops_the_worker_cleanly_and_exits_130(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    command = [
        sys.executable, "-m", "tuitrain.cli", "run", "tiny", "--headless",
        "--steps", "1000000", "--batch-size", "2", "--seq-len", "16", "--precision", "fp32",
        "--metrics", str(metrics), "--checkpoint-dir", str(tmp_path / "ck"),
    ]  # fmt: skip
    # A session of its own: the Ctrl-C below goes to every process in it, as a terminal's
    # does to its foreground group, worker included.
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, cwd=tmp_path,
    )  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=lambda s=stream, lines=lines: lines.extend(s), daemon=True)
        for stream, lines in ((run.stdout, out), (run.stderr, err))
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + START_SECONDS
        while not any(line.startswith("step 1/") for line in out):
            assert run.poll() is None, f"exited early: {''.join(err)}"
            assert time.monotonic() < deadline, "no step within the start-up time"
            time.sleep(0.05)
        worker_pid = int(next(re.search(r"pid (\d+)", x)[1] for x in out if "worker   pid" in x))
        assert psutil.pid_exists(worker_pid)

        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) == 130
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    for reader in readers:
        reader.join(timeout=10)

    assert not psutil.pid_exists(worker_pid), "the worker outlived the command"
    assert _session_empties(run.pid), "a process of the run is still alive"
    stdout, stderr = "".join(out), "".join(err)
    assert "Traceback" not in stdout + stderr
    assert "training failed" not in stderr, "the worker ignored Ctrl-C and stopped cleanly"
    assert "done (stopped early): " in stdout
    assert f"metrics in {metrics}" in stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert "settings" in records[0] and records[-1]["summary"]["stopped"]
    steps = [r["step"] for r in records[1:-1]]
    assert steps and steps == list(range(1, len(steps) + 1))
    # With a checkpoint folder, Ctrl-C leaves a checkpoint of the last step taken.
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"step-{steps[-1]:06d}"]


def _session_empties(session: int, timeout: float = 10.0) -> bool:
    """Whether every process of `session` is gone within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == session and process.status() != "zombie":
                    alive.append(process)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(autouse=True)
def _no_worker_left_behind():
    yield
    assert worker_processes() == []


def test_a_step_with_a_disk_tier_says_what_it_read_wrote_and_waited() -> None:
    from tests.tuitrain.fakeworker import GiB, fake_stats
    from tuitrain.headless import _Report

    def printed(stats) -> str:
        out = io.StringIO()
        report = _Report(settings=tiny_settings(), out=out, err=io.StringIO(), log_path="w.log")
        report.step(stats)
        return out.getvalue()

    line = printed(fake_stats(3, policy="cpu", host_budget=1 * GiB))
    assert re.search(r"step 3/200 .* disk read \d+(\.\d)? [KMG]iB written \d+(\.\d)? [KMG]iB "
                     r"waited \d+\.\d s", line), line
    without = printed(fake_stats(3, policy="cpu"))  # no disk: nothing said of it
    assert "step 3/200" in without and "disk" not in without


# --- what the lines say, without a worker ----------------------------------------------------


def report_on(out: io.StringIO, **training: int):
    from tuitrain.headless import _Report

    settings = tiny_settings(training=training)
    return _Report(settings=settings, out=out, err=io.StringIO(), log_path="w.log")


def test_a_one_step_run_reads_step_and_its_labels_take_one_space():
    from tuitrain.events import Finished, Started

    out = io.StringIO()
    settings = tiny_settings(training={"steps": 1, "warmup_steps": 1, "eval_every": 1},
                             data={"eval_fraction": 0.1})
    report = _Report(settings=settings, out=out, err=io.StringIO(), log_path="w.log")
    report.handle(Started(model="tiny", parameters=657_344, device="simulated, 6.0 GiB",
                          chunks=[], settings=settings.model_dump(mode="json"), pid=7,
                          log_path="w.log"))
    report.handle(Finished(summary={"steps": 1, "tokens": 32, "seconds": 1.5}))
    lines = out.getvalue().splitlines()
    assert "  training 1 step of 2 x 16 tokens, lr 0.0003 constant after 1 warm-up step, " \
        "seed 0" in lines
    assert any(line.endswith("every 1 step and after the last") for line in lines), lines
    assert "done: 1 step, 32 tokens in 1.50 s" in lines
    # The settings' labels make a column as wide as the longest and one space: "training"
    # is followed by one space, and every value starts where its value does.
    labelled = [line for line in lines[1:] if re.match(r"^  [a-z]+ ", line)]
    assert [line.split()[0] for line in labelled] == [
        "engine", "training", "data", "eval", "metrics", "worker"]
    assert {re.match(r"^  [a-z]+ +", line).end() for line in labelled} == {len("  training ")}


class NarrowTerminal(Terminal):
    """A terminal `columns` wide, as os.get_terminal_size would say."""

    def __init__(self, columns: int) -> None:
        super().__init__()
        self.columns = columns

    def fileno(self) -> int:
        return -1


@pytest.mark.parametrize("columns", [120, 80, 60])
def test_a_progress_line_fits_the_terminal_leaving_out_whole_fields(monkeypatch, columns):
    from tests.tuitrain.fakeworker import GiB, fake_stats
    from tuitrain import headless

    monkeypatch.setattr(headless, "_width", lambda stream: columns)
    monkeypatch.setattr(headless, "REDRAW_SECONDS", 0.0)
    out = NarrowTerminal(columns)
    report = report_on(out, steps=200)
    for step in (1, 2, 3):
        report.step(fake_stats(step, policy="cpu", host_budget=1 * GiB))
    drawn = out.getvalue().split("\r")[-1].removesuffix("\x1b[K")
    assert len(drawn) <= columns - 3, "room left for the terminal's ^C echo"
    assert drawn.startswith("[" + "." * 24 + "] step 3/200  ")
    fields = drawn.split("  ")
    # Each field is whole: a size is a number and its unit, never `device peak 919.`.
    for field in fields:
        if field.startswith(("device peak", "disk read")):
            assert re.fullmatch(r"(device peak|disk read) \d+(\.\d)? [KMG]?i?B.*", field), field
    assert re.fullmatch(r"loss \d+\.\d{4}", fields[1])
    if columns == 120:
        assert fields[2].endswith(" ms/step") and fields[3].endswith(" tok/s")
        assert "device peak" in drawn and "margin" not in drawn  # the least important goes


def test_ctrl_c_ends_the_progress_line_drawn_again_before_the_stopping_message():
    from tests.tuitrain.fakeworker import fake_stats

    out = Terminal()
    report = report_on(out, steps=200)
    report.step(fake_stats(1))
    drawn = out.getvalue()
    report.say_err("stopping: the step under way ends at its next layer, and nothing of it "
                   "is kept (Ctrl-C again to stop now)")
    # The line is drawn once more from its start (wiping a `^C` echoed onto it), then ended.
    assert out.getvalue() == drawn + drawn[drawn.index("\r"):] + "\n"


def test_a_headless_run_gives_one_pace_its_trials_in_the_progress_and_the_summary():
    """One definition of the pace, the trials' (medians over settled steps), in one unit:
    the progress line, the summary and its trials say the same figures in the same words."""
    from tests.tuitrain.fakeworker import fake_stats

    out = io.StringIO()
    report = report_on(out, steps=4)
    for step, seconds in ((1, 2.5), (2, 0.03), (3, 0.05), (4, 0.04)):
        stats = fake_stats(step)
        stats.seconds = seconds
        report.step(stats)
    progress = out.getvalue().splitlines()[-1]
    assert "40.0 ms/step  6,400 tok/s" in progress  # medians of steps 2-4, not step 4's own
    report.finished({"steps": 4, "tokens": 1024, "seconds": 3.0, "first_step_seconds": 2.5,
                     "mean_step_seconds": 0.04, "tokens_per_second": 341.3, "final_loss": 2.0,
                     "peak_device_bytes": 2**30, "peak_host_bytes": 2**31, "metrics": None})
    summary = out.getvalue().split(progress)[-1]
    assert "first step 2.50 s" in summary
    assert "40.0 ms/step, 6,400 tok/s (median of 3 settled steps" in summary
    # No other rate, and no other spelling of a step time.
    assert len(re.findall(r"\btok(ens)?/s", summary)) == 1
    assert not re.search(r"\d s/step|mean step", summary)


# --- how a run ends when the terminal stops it, in real processes ------------------------


def _run_command(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tuitrain.cli", "run", "tiny", "--headless",
        "--steps", "1000000", "--batch-size", "2", "--seq-len", "16", "--precision", "fp32",
        "--metrics", str(tmp_path / "metrics.jsonl"), *extra,
    ]  # fmt: skip


def _until(done, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _records(tmp_path: Path) -> tuple[list[dict], dict]:
    """The step lines of the run's metrics, and the summary that must be its last line."""
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "settings" in records[0]
    assert "summary" in records[-1], f"the metrics end on {list(records[-1])[:3]}"
    steps = [r for r in records[1:-1] if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    return steps, records[-1]["summary"]


def _listed(runtime_dir: Path) -> str:
    from tuitrain.runs import list_runs

    [record] = list_runs(runtime_dir)
    return record.state


def _end(*processes: subprocess.Popen, session: int) -> None:
    """Whatever a failed assertion left running: the run's whole session, and the readers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session, signal.SIGCONT)
        os.killpg(session, signal.SIGKILL)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


@contextlib.contextmanager
def _ended(run: subprocess.Popen, readers: list[threading.Thread]) -> Iterator[None]:
    """Inside, the test stops `run` (in a session of its own) as a user would; after it,
    whatever a failed assertion left running is ended, what the run said is all read, and
    no process of its session may be left."""
    try:
        yield
    finally:
        _end(run, session=run.pid)
    for reader in readers:
        reader.join(timeout=10)
    assert _session_empties(run.pid), "a process of the run is still alive"


def test_a_ctrl_c_that_ends_the_tee_first_still_ends_the_run_as_ctrl_c_does(
        tmp_path: Path, runtime_dir: Path) -> None:
    """`tuitrain run ... 2>&1 | tee out`, then Ctrl-C: the terminal signals the whole group,
    and tee, gone first, takes the output with it. The run ends as after any Ctrl-C: the
    last step checkpointed, the summary the metrics' last line, listed `interrupted`."""
    read_end, write_end = os.pipe()
    shown = tmp_path / "shown"
    with shown.open("wb") as copy:
        tee = subprocess.Popen(["cat"], stdin=read_end, stdout=copy)
    run = subprocess.Popen(
        _run_command(tmp_path, "--checkpoint-dir", str(tmp_path / "ck")), cwd=tmp_path,
        stdout=write_end, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(read_end)
    os.close(write_end)
    try:
        _until(lambda: "\nstep 1/" in shown.read_text() or run.poll() is not None,
               START_SECONDS, "the first step")
        assert run.poll() is None, shown.read_text()
        tee.send_signal(signal.SIGINT)
        assert tee.wait(timeout=10) != 0
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) == 130
    finally:
        _end(run, tee, session=run.pid)

    assert _session_empties(run.pid), "a process of the run is still alive"
    steps, summary = _records(tmp_path)
    assert summary["stopped"] and summary["last_step"] == steps[-1]["step"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        f"step-{steps[-1]['step']:06d}"]
    assert _listed(runtime_dir) == "interrupted"


def test_a_reader_that_goes_away_ends_the_run_soon_with_its_summary_and_no_noise(
        tmp_path: Path, runtime_dir: Path) -> None:
    """`tuitrain run ... | head -11`: as a Unix tool ends when its reader goes, the run
    stops, as Ctrl-C stops it, once head has its lines; stderr says so and nothing else."""
    read_end, write_end = os.pipe()
    # Past the settings block to the first step line: the worker trains by then (before,
    # it has nothing to keep, and is ended at once).
    head = subprocess.Popen(["head", "-11"], stdin=read_end, stdout=subprocess.PIPE)
    with (tmp_path / "err").open("w") as err:
        run = subprocess.Popen(_run_command(tmp_path), cwd=tmp_path, stdout=write_end,
                               stderr=err, start_new_session=True)
    os.close(read_end)
    os.close(write_end)
    try:
        shown = head.communicate(timeout=START_SECONDS)[0].decode().splitlines()
        assert len(shown) == 11 and shown[0].startswith("starting tiny"), shown
        assert shown[-1].startswith("step 1/"), shown
        assert run.wait(timeout=START_SECONDS) == 141  # 128 + SIGPIPE, as a shell says
    finally:
        _end(run, head, session=run.pid)

    assert _session_empties(run.pid), "a process of the run is still alive"
    said = (tmp_path / "err").read_text().splitlines()
    assert len(said) == 2, said  # no traceback, no "Exception ignored"
    assert said[0] == ("stopping (nothing reads the output any more): the step under way "
                       "ends at its next layer, and nothing of it is kept")
    metrics = re.escape(str(tmp_path / "metrics.jsonl"))
    assert re.fullmatch(rf"interrupted after step \d+; metrics in {metrics}", said[1]), said
    _, summary = _records(tmp_path)
    assert summary["stopped"]
    assert _listed(runtime_dir) == "interrupted"


def _run_to_its_first_step(tmp_path: Path, *args: str
                           ) -> tuple[subprocess.Popen, list[str], list[str], list]:
    """A headless run started as _started starts one, once its first step is in."""
    return _started(_run_command(tmp_path, *args), tmp_path, "step 1/")


def _started(command: list[str], tmp_path: Path, said: str, env: dict | None = None
             ) -> tuple[subprocess.Popen, list[str], list[str], list[threading.Thread]]:
    """`command` in a session of its own (a signal to the group reaches every process of
    it, as a terminal's does), its output read as it comes, once a line of its output
    starts with `said`: the process, its stdout and stderr lines so far, and the threads
    reading them."""
    run = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=stream, lines=lines: lines.extend(s),
                                daemon=True) for stream, lines in ((run.stdout, out),
                                                                   (run.stderr, err))]
    for reader in readers:
        reader.start()
    try:
        _until(lambda: any(line.startswith(said) for line in out) or run.poll() is not None,
               START_SECONDS, said)
        assert run.poll() is None, "".join(err)
    except BaseException:
        _end(run, session=run.pid)
        raise
    return run, out, err, readers


def test_a_second_ctrl_c_stops_at_once_as_it_says_and_the_run_ends_interrupted(
        tmp_path: Path, runtime_dir: Path) -> None:
    """Ctrl-C offers "Ctrl-C again to stop now": the second does that, with no wait for the
    step under way (here a worker that cannot move at all), and it is no failure: one line,
    exit status 130, the summary in the metrics, listed `interrupted`."""
    run, out, err, readers = _run_to_its_first_step(tmp_path, "--checkpoint-dir",
                                                    str(tmp_path / "ck"))
    with _ended(run, readers):
        worker = int(next(re.search(r"pid (\d+)", x)[1] for x in out if "worker   pid" in x))
        os.kill(worker, signal.SIGSTOP)  # a step that would take long to end
        os.killpg(run.pid, signal.SIGINT)
        _until(lambda: any(line.startswith("stopping:") for line in err), 30, "the first stop")
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=30) == 130
    assert not psutil.pid_exists(worker)
    steps, summary = _records(tmp_path)
    assert summary["stopped"] and summary["stopped_now"]
    # The steps the run reported; the worker, frozen then ended at once, may have written
    # the line of one more, or sent the last without writing its line.
    last = summary["last_step"]
    assert abs(last - steps[-1]["step"]) <= 1 and summary["steps"] == last
    assert [line.rstrip("\n") for line in err] == [
        "stopping: the step under way ends at its next layer, and nothing of it is kept "
        "(Ctrl-C again to stop now)",
        f"stopped now after step {last}: the step under way was not kept; no checkpoint "
        f"was written; metrics in {tmp_path / 'metrics.jsonl'}",
    ]  # fmt: skip
    assert "done (stopped early): " in "".join(out)
    assert not list((tmp_path / "ck").glob("step-*")), "no checkpoint on the way out"
    assert _listed(runtime_dir) == "interrupted"


def test_a_reader_gone_after_the_last_step_stops_nothing_and_says_nothing():
    """`run ... | head -13` where head has its lines once the last step is reported: the run
    is ending as it is, so no stop is asked for (the worker would refuse it: training has
    finished) and nothing says one is under way."""
    import io

    from tests.tuitrain.fakeworker import fake_stats
    from tuitrain.headless import _follow, _Report
    from tuitrain.stop_requests import Stopping, StopRequests

    class Gone:
        def reader_gone(self) -> bool:
            return True

    class Ending:  # a worker whose last step is in; it ends on its second look
        sent: list = []
        looks = 0

        def wait(self, seconds: float) -> None:
            pass

        def poll(self) -> list:
            self.looks += 1
            if self.looks > 1:
                raise EOFError("the run ended")
            return []

        def send(self, command) -> None:
            self.sent.append(command)

    err = io.StringIO()
    report = _Report(settings=Settings(model="tiny", training={"steps": 3}), out=io.StringIO(),
                     err=err, log_path="worker.log")
    report.latest = fake_stats(3)
    worker = Ending()
    with pytest.raises(EOFError):
        _follow(worker, report, Stopping(StopRequests((Gone(),)), worker, report.say_err))
    assert worker.sent == [] and "stopping" not in err.getvalue()
    report.latest = fake_stats(2)  # a step to go: the reader's going stops the run
    worker.looks = 0
    with pytest.raises(EOFError):
        _follow(worker, report, Stopping(StopRequests((Gone(),)), worker, report.say_err))
    assert len(worker.sent) == 1 and "stopping (nothing reads the output" in err.getvalue()


@pytest.mark.parametrize(("signum", "to", "status"), [
    (signal.SIGTERM, "the run", 143), (signal.SIGTERM, "its process group", 143),
    (signal.SIGHUP, "its process group", 129)])
def test_sigterm_or_a_closed_terminal_stops_a_run_at_once_with_its_summary(
        tmp_path: Path, runtime_dir: Path, signum: int, to: str, status: int) -> None:
    """`kill PID`, or a batch system's time limit signalling every process of the job: the
    run stops at once, as after a second Ctrl-C, and still ends its metrics with the
    summary; exit status 143 (128 + SIGTERM), listed `interrupted`. SIGHUP to the group, as
    the terminal it runs in sends when it closes (`tmux kill-session`, a dropped ssh), does
    the same, exit status 129; its worker is held back from the hangup, so that the run
    ends it, not the signal."""
    run, out, err, readers = _run_to_its_first_step(tmp_path)
    with _ended(run, readers):
        if to == "the run":
            os.kill(run.pid, signum)
        else:
            os.killpg(run.pid, signum)
        assert run.wait(timeout=30) == status
    _, summary = _records(tmp_path)
    assert summary["stopped"] and summary["stopped_now"]
    said = [line.rstrip("\n") for line in err]
    assert len(said) == 1 and said[0].startswith(
        f"stopped now after step {summary['last_step']}: the step under way was not kept"), said
    assert _listed(runtime_dir) == "interrupted"


def test_a_sigterm_that_comes_while_events_are_relayed_is_a_stop_now_and_says_no_stopping():
    """The handler can run between any two lines of the loop: a SIGTERM that came while the
    step's events were shown must not read as a first Ctrl-C ("stopping... Ctrl-C again")
    on its way to stopping at once."""
    from tuitrain.headless import _follow
    from tuitrain.stop_requests import Stopping, StopRequests

    interrupts = StopRequests()

    class Signalled:  # SIGTERM's handler runs while the first look's events are handled
        sent: list = []

        def wait(self, seconds: float) -> None:
            pass

        def poll(self) -> list:
            interrupts._on_sigterm(signal.SIGTERM, None)
            return []

        def send(self, command) -> None:
            self.sent.append(command)

    err = io.StringIO()
    report = _Report(settings=Settings(model="tiny", training={"steps": 3}), out=io.StringIO(),
                     err=err, log_path="worker.log")
    worker = Signalled()
    assert _follow(worker, report, Stopping(interrupts, worker, report.say_err)) is None
    assert worker.sent == [] and err.getvalue() == ""


def test_a_stop_before_the_run_began_says_its_metrics_file_was_not_written():
    """Two quick Ctrl-C while the worker still builds the model: the worker had not begun
    the metrics file, and the summary made for it says so (metrics None), so the last line
    must not send the user to a file that does not exist (or holds an earlier run's)."""
    from tuitrain.events import Finished
    from tuitrain.run_summary import StepTally

    settings = Settings(model="tiny", training={"steps": 3}, logging={"metrics": "m.jsonl"})
    for began, said in ((False, "nothing was written to m.jsonl"), (True, "metrics in m.jsonl")):
        err = io.StringIO()
        report = _Report(settings=settings, out=io.StringIO(), err=err, log_path="worker.log")
        summary = StepTally().summary(settings, seconds=1.0, log="worker.log")
        if not began:
            summary["metrics"] = None  # as ProcessWorker._stopped_report makes it
        report.handle(Finished(summary=summary))
        report.interrupted(now=True)
        last = err.getvalue().splitlines()[-1]
        assert last.startswith("stopped before its first step; ") and said in last, last
        assert began or "metrics in" not in last, last


def test_a_stop_that_came_after_the_last_step_is_not_reported_as_rejected():
    """A Ctrl-C (or, under --nproc, a rank's Stop) just as the last step ends: the worker
    refuses the Stop, training having finished, and the run ends as it was going to. That
    refusal is no news to the user; any other still is."""
    from tuitrain.events import TRAINING_FINISHED, Rejected

    err = io.StringIO()
    report = _Report(settings=Settings(model="tiny"), out=io.StringIO(), err=err,
                     log_path="worker.log")
    report.handle(Rejected(1, TRAINING_FINISHED))
    assert err.getvalue() == ""
    report.handle(Rejected(2, "the command channel closed"))
    assert err.getvalue() == "rejected: the command channel closed\n"


def test_a_ctrl_c_before_the_worker_has_started_ends_it_at_once():
    """While the worker builds the model or reads the data it has trained nothing and reads
    no command: a first Ctrl-C ends it at once, rather than a Stop that would go unread
    until the 30 s wait ran out and the run was reported failed."""
    from tuitrain.stop_requests import Stopping, StopRequests

    class Starting:
        started = None
        sent: list = []
        ended = ""

        def send(self, command) -> int:
            self.sent.append(command)
            return 1

        def stop(self, timeout: float = 0.0) -> None:
            self.ended = "waited for"

        def stop_now(self, *, keep_log: bool = False) -> None:
            self.ended = "at once"

    requests, said, worker = StopRequests(), [], Starting()
    stopping = Stopping(requests, worker, said.append)
    assert not stopping.look()
    requests._on_sigint(signal.SIGINT, None)
    assert stopping.look() and stopping.asked and said == [] and worker.sent == []
    stopping.end()
    assert worker.ended == "at once" and stopping.status() == 130


def test_a_sigterm_as_the_run_ends_finds_it_finished_and_nothing_is_left(tmp_path: Path,
                                                                           runtime_dir: Path):
    """`done` is printed, and the job is sent SIGTERM as the worker exits (a batch system's
    end, a user who sees the process linger): the run had finished, so it ends as finished
    (exit 0, no word of a stop), and the worker, ended by that SIGTERM with its run done,
    leaves no log."""
    (tmp_path / "tmp").mkdir()
    command = [*_run_command(tmp_path)]
    command[command.index("1000000")] = "30"
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    try:
        for line in run.stdout:
            if line.startswith("done"):
                os.killpg(run.pid, signal.SIGTERM)
                break
        _, err = run.communicate(timeout=30)
    finally:
        _end(run, session=run.pid)
    assert run.returncode == 0 and err == "", err
    assert _session_empties(run.pid)
    _, summary = _records(tmp_path)
    assert not summary["stopped"]
    logs = tmp_path / "tmp" / "tuitrain"
    assert not logs.exists() or list(logs.iterdir()) == []
    assert _listed(runtime_dir) == "finished"
