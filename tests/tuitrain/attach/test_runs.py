"""The runtime folder and its records: private, listed newest last, stale runs cleaned."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.tuitrain.fakeworker import fake_stats
from tuitrain import runs
from tuitrain.attach import open_run, runs_listing
from tuitrain.cli import main
from tuitrain.errors import UsageError
from tuitrain.metrics import MetricsWriter
from tuitrain.runs import (
    ENV_FOLDER,
    RuntimeFolderError,
    find_run,
    list_runs,
    new_record,
    record_path,
    runtime_folder,
    write_record,
)
from tuitrain.settings import Settings


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_folder_is_made_owner_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_FOLDER, str(tmp_path / "made"))
    folder = runtime_folder()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    os.chmod(folder, 0o755)  # ours, opened up by hand: made private again
    assert stat.S_IMODE(runtime_folder().stat().st_mode) == 0o700


def test_a_folder_of_another_user_is_refused(runtime_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: runtime_dir.stat().st_uid + 1)
    with pytest.raises(RuntimeFolderError, match="belongs to another user"):
        runtime_folder()


def test_runs_on_a_folder_of_another_user_is_one_line_and_exit_2(
        runtime_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(os, "getuid", lambda: runtime_dir.stat().st_uid + 1)
    assert main(["runs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "belongs to another user" in err


def test_a_live_record_of_a_dead_process_is_gone_and_its_socket_removed(
        runtime_dir: Path) -> None:
    record = replace(new_record(model="tiny", metrics="", steps=10, folder=runtime_dir),
                     pid=dead_pid())
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(record.socket)  # a socket file that nobody listens on any more
    stale.close()
    write_record(runtime_dir, record)
    [listed] = list_runs(runtime_dir)
    assert listed.state == "gone" and not Path(record.socket).exists()
    with pytest.raises(LookupError, match="no live run"):
        find_run(runtime_dir, None)


def test_attaching_to_a_dead_run_says_so_in_one_line_with_exit_2(
        runtime_dir: Path, capsys) -> None:
    record = replace(new_record(model="tiny", metrics="", steps=10, folder=runtime_dir),
                     pid=dead_pid())
    write_record(runtime_dir, record)
    assert main(["attach", record.id]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "gone (its process ended without a word)" in err and "no metrics file" in err


def test_a_live_record_whose_socket_refuses_is_an_error_not_a_hang(
        runtime_dir: Path) -> None:
    record = new_record(model="tiny", metrics="", steps=10, folder=runtime_dir)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(record.socket)  # this process lives, but nothing listens there
    stale.close()
    write_record(runtime_dir, record)
    with pytest.raises(UsageError, match="cannot attach"):
        open_run(record.id, read_only=False)


def test_a_live_record_without_its_socket_is_a_pid_taken_by_another_process(
        runtime_dir: Path) -> None:
    record = new_record(model="tiny", metrics="", steps=10, folder=runtime_dir)
    write_record(runtime_dir, record)  # this process lives; it never made that socket
    [listed] = list_runs(runtime_dir)
    assert listed.state == "gone"


def test_runs_are_found_by_id_prefix_or_pid_and_listed(runtime_dir: Path) -> None:
    (runtime_dir / "m.jsonl").write_text("")
    first = replace(new_record(model="tiny", metrics=str(runtime_dir / "m.jsonl"), steps=10,
                               folder=runtime_dir), id="20260101-000000-11", pid=11,
                    started=1.0, state="finished", step=10, socket="")
    second = replace(first, id="20260102-000000-12", pid=12, started=2.0, state="failed")
    for record in (first, second):
        write_record(runtime_dir, record)
    assert find_run(runtime_dir, "12").id == second.id
    assert find_run(runtime_dir, "20260101").id == first.id
    with pytest.raises(LookupError, match="names 2 runs"):
        find_run(runtime_dir, "2026010")
    with pytest.raises(LookupError, match="no run 'nope'"):
        find_run(runtime_dir, "nope")
    lines = runs_listing()
    assert lines[0].split() == ["RUN", "MODEL", "STEP", "STATE", "STARTED", "ATTACH", "TO"]
    assert "finished" in lines[1] and "10/10" in lines[1] and lines[1].endswith("m.jsonl")
    assert "failed" in lines[2]


def test_a_metrics_file_given_relative_is_found_from_another_folder(
        runtime_dir: Path, tmp_path: Path, monkeypatch) -> None:
    started_in, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started_in.mkdir()
    elsewhere.mkdir()
    metrics = started_in / "m.jsonl"
    metrics.write_text(json.dumps({"settings": Settings(model="tiny").model_dump(mode="json")}))
    monkeypatch.chdir(started_in)
    record = replace(new_record(model="tiny", metrics="m.jsonl", steps=10, folder=runtime_dir),
                     state="finished", socket="")
    assert record.metrics == str(metrics)
    write_record(runtime_dir, record)
    monkeypatch.chdir(elsewhere)
    client, settings = open_run(record.id, read_only=True)
    assert settings.model == "tiny"
    assert runs_listing()[1].endswith(str(metrics))


def test_a_run_that_ended_before_writing_its_metrics_offers_none(
        runtime_dir: Path, tmp_path: Path) -> None:
    never = tmp_path / "never.jsonl"
    record = replace(new_record(model="tiny", metrics=str(never), steps=10,
                                folder=runtime_dir), state="failed", socket="")
    write_record(runtime_dir, record)
    assert runs_listing()[1].endswith("(metrics file not written)")
    assert str(never) not in runs_listing()[1]
    with pytest.raises(UsageError) as refused:
        open_run(record.id, read_only=True)
    assert str(refused.value) == (f"run {record.id} has failed and its metrics file {never} "
                                  "is not there: there is nothing to show")


def test_attach_without_a_terminal_names_ssh_t_in_one_line_with_exit_2(
        tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "run.jsonl"
    metrics.write_text(json.dumps({"settings": Settings(model="tiny").model_dump(mode="json")}))
    # pytest's stdin is not a terminal, as a command's under `ssh host command` is not
    assert main(["attach", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ssh -t HOST tuitrain attach" in err


def test_flags_that_contradict_or_do_nothing_are_one_line_with_exit_2(capsys) -> None:
    assert main(["attach", "123", "--yes"]) == 2
    assert capsys.readouterr().err == (
        "tuitrain: error: --yes answers --stop's question; without --stop it has nothing "
        "to do\n")
    assert main(["attach", "123", "--stop", "--read-only"]) == 2
    assert capsys.readouterr().err == (
        "tuitrain: error: --stop sends the run a stop, which --read-only never does: give "
        "one\n")


def write_steps(path: Path, steps: range, *, evaluated: bool = False) -> None:
    """A run's metrics as the worker writes them: its settings line, then its steps."""
    writer = MetricsWriter(path)
    writer.write({"settings": Settings(model="tiny").model_dump(mode="json")})
    for step in steps:
        writer.write(asdict(fake_stats(step)))
    if evaluated:  # its nested "step" is not a step line
        writer.write({"eval": {"step": 999, "loss": 2.0}})
    writer.close()


def test_a_running_or_killed_run_is_listed_at_the_step_its_metrics_reached(
        runtime_dir: Path, tmp_path: Path, monkeypatch) -> None:
    metrics = tmp_path / "m.jsonl"
    # Its record is rewritten every few seconds at most, and a killed run's never again.
    record = replace(new_record(model="tiny", metrics=str(metrics), steps=3000,
                                folder=runtime_dir), step=1)
    write_steps(metrics, range(1, 21), evaluated=True)
    monkeypatch.setattr(runs, "METRICS_TAIL_BYTES", 3 * len(metrics.read_text()) // 20)
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(record.socket)  # this process lives and its socket is there: running
    try:
        write_record(runtime_dir, record)
        [listed] = list_runs(runtime_dir)
        assert listed.live and listed.step == 20
        assert "20/3000" in runs_listing()[1]
    finally:
        listening.close()
    write_record(runtime_dir, replace(record, pid=dead_pid()))  # kill -9
    [listed] = list_runs(runtime_dir)
    assert (listed.state, listed.step) == ("gone", 20)
    assert json.loads(record_path(runtime_dir, record.id).read_text())["step"] == 20


def test_a_metrics_file_written_before_the_run_started_gives_it_no_step(
        runtime_dir: Path, tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.jsonl"
    write_steps(earlier, range(1, 11))  # an earlier run's; this one was killed before a line
    an_hour_ago = time.time() - 3600
    os.utime(earlier, (an_hour_ago, an_hour_ago))
    started = tmp_path / "started.jsonl"
    write_steps(started, range(1, 11))
    write_steps(started, range(0))  # this run wrote its settings, then was killed
    for path in (earlier, started):
        record = new_record(model="tiny", metrics=str(path), steps=30, folder=runtime_dir)
        write_record(runtime_dir, replace(record, id=f"{record.id}-{path.stem}",
                                          pid=dead_pid(), started=an_hour_ago + 1))
    assert [(r.state, r.step) for r in list_runs(runtime_dir)] == [("gone", 0), ("gone", 0)]
