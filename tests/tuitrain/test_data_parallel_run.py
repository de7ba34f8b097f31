"""Data parallel from the command line: `tuitrain run tiny --nproc N --headless` (the ranks
started by tuitrain itself, tuitrain.launch), killed and resumed on another world size.

One launch of two gloo ranks on this CPU, with checkpoints every two steps; once the first is
written, rank 1's worker (the process that trains, which the out-of-memory killer would
pick) gets SIGKILL. The launcher must exit non-zero well within the ranks' collective
timeout, its last line naming rank 1 as the rank that failed first. The newest complete
checkpoint then resumes on three ranks (resharded from two) and goes on exactly. Both runs
train the same global batches as one process (so the same losses, in fp32 within 1e-5);
rank 0 alone writes the metrics and the checkpoint, every rank logs to a file of its own.
The two launches run once for the module; each test checks one thing they did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rank_launch import (
    ROOT,
    TOL,
    environment,
    launched,
    losses_in,
    one_process,
    rank_logs,
    run,
    worker_pid,
)

from engine.distributed.collectives import DEFAULT_TIMEOUT
from tuitrain import ranks
from tuitrain.checkpoint import find_checkpoint, step_folder

# Both launches and the reference count in the first test: what two tests had before.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

EVERY = 2  # --checkpoint-every and --eval-every of the run that is killed
# The ranks' collectives wait up to DEFAULT_TIMEOUT (600 s: --collective-timeout is not
# given). A dead rank must not cost that: its own run reports its worker's death within a
# second and exits, the launcher then stops the others; its connections closing fails
# the survivors' collectives at once. So the bound is a small fraction of the timeout.
STOP_BOUND = 30.0
assert STOP_BOUND < DEFAULT_TIMEOUT / 10
START_DEADLINE = 150.0  # seconds for the ranks to start and write their first checkpoint


@dataclass
class Killed:
    """The two-rank launch killed after its first checkpoint."""

    status: int
    stopped: float  # seconds from the SIGKILL to the launcher's exit
    stderr: str
    checkpoints: Path
    saved: int  # the step of its newest complete checkpoint
    metrics: Path
    tmp: Path  # its TMPDIR


@dataclass
class Resumed:
    """The three-rank launch resuming the killed run's newest checkpoint for two steps."""

    done: subprocess.CompletedProcess
    checkpoints: Path
    metrics: Path
    preset: Path
    tmp: Path


@dataclass
class Launches:
    killed: Killed
    resumed: Resumed
    expected: list[float]  # one process's loss at each step
    expected_evals: dict[int, float]  # and its held-out loss after each even step


def evaluated(metrics: Path) -> set[int]:
    """The steps after which a held-out loss is in `metrics`, as far as it is written."""
    if not metrics.is_file():
        return set()
    whole = metrics.read_text().splitlines(keepends=True)
    return {json.loads(line)["eval"]["step"] for line in whole
            if line.endswith("\n") and line.startswith('{"eval"')}


def kill_rank_1_after_the_first_checkpoint(tmp: Path) -> Killed:
    ck, metrics = tmp / "ck", tmp / "killed.jsonl"
    tmp.mkdir()
    with open(tmp / "out", "w") as out, open(tmp / "err", "w") as err:
        launch = subprocess.Popen(
            launched(2, "--steps", "1000", "--checkpoint-dir", str(ck),
                     "--checkpoint-every", str(EVERY), "--eval-every", str(EVERY),
                     "--metrics", str(metrics)),
            cwd=ROOT, env=environment(tmp), stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + START_DEADLINE
            # The checkpoint after step EVERY is written, then the held-out loss scored.
            while not (step_folder(ck, EVERY).is_dir() and EVERY in evaluated(metrics)):
                assert launch.poll() is None, (tmp / "err").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.05)
            os.kill(worker_pid(tmp, 1), signal.SIGKILL)
            killed = time.monotonic()
            status = launch.wait(timeout=STOP_BOUND)
            stopped = time.monotonic() - killed
        finally:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
    newest = find_checkpoint(ck)  # the newest complete one: never one cut short
    return Killed(status=status, stopped=stopped, stderr=(tmp / "err").read_text(),
                  checkpoints=ck, saved=int(newest.name.removeprefix("step-")),
                  metrics=metrics, tmp=tmp)


def resume_on_three_ranks(killed: Killed, tmp: Path) -> Resumed:
    ck, metrics, preset = tmp / "ck", tmp / "resumed.jsonl", tmp / "three.yaml"
    done = run(launched(3, "--steps", str(killed.saved + 2), "--resume",
                        str(killed.checkpoints), "--checkpoint-dir", str(ck),
                        "--metrics", str(metrics), "--save-preset", str(preset)), tmp)
    return Resumed(done=done, checkpoints=ck, metrics=metrics, preset=preset, tmp=tmp)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    base = tmp_path_factory.mktemp("launches")
    killed = kill_rank_1_after_the_first_checkpoint(base / "killed")
    resumed = resume_on_three_ranks(killed, base / "resumed")
    steps, _ = losses_in(killed.metrics)
    last = max([killed.saved + 2, *steps])  # the killed run may have gone past `saved`
    expected, evals = one_process(last, evaluated=tuple(range(EVERY, last + 1, EVERY)))
    return Launches(killed, resumed, expected, evals)


def test_a_rank_killed_with_sigkill_stops_the_run_naming_it(launches):
    killed = launches.killed
    assert killed.status != 0
    print(f"the launcher exited {killed.stopped:.1f} s after the kill, status {killed.status}")
    last = killed.stderr.strip().splitlines()[-1]
    # Rank 1 alone is named, whether rank 0's collectives failed first (the connection to
    # rank 1 reset) or the launcher stopped it: rank 1's worker was killed, the cause.
    assert last == ("tuitrain: rank 1 of 2 failed first (exit status 1); the other rank was "
                    "stopped because of it")
    assert "rank 1: training failed: worker exited with signal 9 (SIGKILL)" in killed.stderr
    assert rank_logs(killed.tmp) == ["rank0", "rank1"]  # a file of its own for each rank


def test_ranks_train_the_global_batches_as_one_process(launches):
    killed = launches.killed
    assert killed.saved >= EVERY and killed.saved % EVERY == 0
    got, evals = losses_in(killed.metrics)
    assert [got[s] for s in range(1, killed.saved + 1)] == pytest.approx(
        launches.expected[:killed.saved], rel=TOL)
    # The held-out loss too: each rank scores its part, the parts add up by weight.
    assert EVERY in evals
    assert evals == pytest.approx({s: launches.expected_evals[s] for s in evals}, rel=TOL)


def test_resume_after_the_kill_on_another_world_size_goes_on_exactly(launches):
    saved, resumed = launches.killed.saved, launches.resumed
    assert resumed.done.returncode == 0, (resumed.done.stdout[-3000:]
                                         + resumed.done.stderr[-3000:])
    assert "3 ranks (gloo)" in resumed.done.stdout
    got, evals = losses_in(resumed.metrics)
    assert sorted(got) == [saved + 1, saved + 2]
    # Resharded from two ranks to three, the run goes on as if it had never stopped.
    assert [got[saved + 1], got[saved + 2]] == pytest.approx(
        launches.expected[saved:saved + 2], rel=TOL)
    assert evals == pytest.approx({saved + 2: launches.expected_evals[saved + 2]}, rel=TOL)


def test_rank_0_alone_writes_the_metrics_the_summary_and_the_checkpoint(launches):
    resumed = launches.resumed
    assert resumed.done.returncode == 0, resumed.done.stderr[-3000:]
    assert resumed.done.stdout.count("done: 2 steps, 192 tokens") == 1  # rank 0's summary
    got, _ = losses_in(resumed.metrics)
    assert len(got) == 2  # one line per step
    last = launches.killed.saved + 2
    assert sorted(p.name for p in resumed.checkpoints.iterdir()) == [f"step-{last:06d}"]
    assert (step_folder(resumed.checkpoints, last) / "model" / "config.json").is_file()
    # Each rank logged to a file of its own (the killed run's are kept, above); a run that
    # ended cleanly leaves none behind.
    assert rank_logs(resumed.tmp) == []


def test_a_launch_leaves_no_folder_of_the_launchers_in_the_temporary_folder(launches):
    """torchrun's launcher keeps each rank's error file in a folder it makes in TMPDIR and,
    left to itself, never removes: one more `torchelastic_*` per run. The launch removes
    its own, whether the run ended cleanly or a rank failed."""
    for tmp in (launches.killed.tmp, launches.resumed.tmp):
        left = [p.name for p in tmp.iterdir()
                if p.name.startswith(("torchelastic_", "tuitrain-launch-"))]
        assert left == [], tmp


def test_the_preset_saved_from_ranks_runs_again_on_as_many(launches):
    resumed = launches.resumed
    assert f"preset saved to {resumed.preset}" in resumed.done.stdout
    header = [line for line in resumed.preset.read_text().splitlines() if line.startswith("#")]
    assert (f"# reproduce: tuitrain run --preset {resumed.preset} --headless --nproc 3"
            in header)


def test_a_global_batch_splits_into_contiguous_equal_parts():
    import torch

    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(12).view(6, 2)}
    parts = [ranks.Ranks(r, 3).slice(batch) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert [p["labels"].shape[0] for p in parts] == [2, 2, 2]
    assert ranks.Ranks().slice(batch) is batch
    # Held-out batches need not split evenly: near-equal parts, and a rank left without a
    # row scores one that counts for nothing.
    short = {"input_ids": torch.arange(10).view(5, 2)}
    parts = [ranks.Ranks(r, 3).eval_part(short) for r in range(3)]
    assert [counted for _, counted in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p, _ in parts]), short["input_ids"])
    single = {"input_ids": torch.arange(2).view(1, 2)}
    assert [ranks.Ranks(r, 2).eval_part(single)[1] for r in range(2)] == [1, 0]
    assert ranks.Ranks(1, 2).eval_part(single)[0]["input_ids"].shape[0] == 1


def test_with_accumulation_the_ranks_kth_micro_batches_are_one_process_kth():
    """So that each rank's dropout masks, its rows of the whole micro-batch's, are one
    process's (engine.step.dropout)."""
    import torch

    from engine.step.engine import split_batch

    batch = {"input_ids": torch.arange(24).view(12, 2)}  # 3 micro-batches of 4
    parts = [split_batch(ranks.Ranks(r, 2).slice(batch, 3), 3) for r in range(2)]
    for k, whole in enumerate(split_batch(batch, 3)):
        ranks_kth = torch.cat([parts[r][k]["input_ids"] for r in range(2)])
        assert torch.equal(ranks_kth, whole["input_ids"]), f"micro-batch {k}"
    with pytest.raises(ValueError, match="batch_size 5 does not split evenly over 2 ranks"):
        ranks.Ranks(0, 2).check_batch(5)


def test_torchruns_environment_names_the_rank():
    assert ranks.from_environment({}) == ranks.Ranks(0, 1, 0)
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert ranks.from_environment(env) == ranks.Ranks(3, 4, 1)
    with pytest.raises(ValueError, match="RANK=4 is not a rank of WORLD_SIZE=4"):
        ranks.from_environment({"WORLD_SIZE": "4", "RANK": "4"})


def test_the_launcher_refuses_what_cannot_run_before_starting_a_rank():
    from tuitrain.launch import check_nproc, launch, rank_arguments

    argv = ["tiny", "--nproc", "2", "--headless", "--save-preset", "p.yaml", "--steps", "5",
            "--nproc=3", "--save-preset=q.yaml", "--force"]
    # --force is --save-preset's: a rank given it without --save-preset would refuse it.
    assert rank_arguments(argv) == ["tiny", "--headless", "--steps", "5"]

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="--nproc: must be a whole number of ranks"):
            check_nproc(bad)
    assert check_nproc(3) == 3
    with pytest.raises(ValueError, match="batch_size 4 does not split evenly over 3 ranks"):
        launch(3, ["tiny", "--headless"], batch_size=4)


def test_ranks_the_launcher_started_leave_the_checks_to_it(monkeypatch):
    """The launcher checks the run (the model, the files named) on this machine before it
    starts a rank; the ranks it starts do not check it again (which imports torch and
    transformers, seconds of CPU in each), while a rank torchrun started does."""
    import gc

    import torch.distributed.launcher.api as launcher_api

    from tuitrain import cli, headless, launch, run_checks

    marked: list[bool] = []

    def elastic_launch(config, entry):
        return lambda *args: marked.append(launch.checked_by_launcher())

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # this test process's collector stays
    monkeypatch.delenv(launch.CHECKED_ENV, raising=False)
    assert launch.launch(2, ["tiny", "--headless"], batch_size=4) == 0
    assert marked == [True]  # in the ranks' environment, and not left in this one
    assert not launch.checked_by_launcher()

    checked: list[str] = []
    monkeypatch.setattr(run_checks, "check_runnable", lambda s, given=None: checked.append(s.model))
    monkeypatch.setattr(headless, "run_headless", lambda settings, **kw: 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    argv = ["run", "tiny", "--headless", "--batch-size", "4", "--steps", "1"]
    assert cli.main(argv) == 0
    assert checked == ["tiny"]  # under torchrun: checked by the rank itself
    monkeypatch.setenv(launch.CHECKED_ENV, "1")
    assert cli.main(argv) == 0
    assert checked == ["tiny"]  # started by tuitrain's launcher: not again


def test_the_launcher_kills_a_stopped_leftover_without_waiting_for_it(monkeypatch):
    """A hung rank's worker (stopped) that outlives its rank cannot end by itself: the
    launcher kills it before it waits for its leftovers, so it does not wait in vain."""
    import psutil

    from tuitrain import launch

    before = launch._children()
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        # A signal is delivered a moment after kill returns: wait until the child is
        # stopped, as a hung rank's worker is long before its rank ends.
        stopped_by = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < stopped_by, "the child never stopped"
            time.sleep(0.01)
        firsts: list[dict[int, int]] = []
        real = psutil.wait_procs

        def wait_procs(procs, timeout=None):
            gone, alive = real(procs, timeout=timeout)
            firsts.append({p.pid: p.returncode for p in gone})
            return gone, alive

        monkeypatch.setattr(psutil, "wait_procs", wait_procs)
        monkeypatch.setattr(launch, "LEFTOVER_GRACE_SECONDS", 1.0)
        launch._end_leftovers(before)
        # Killed before the first wait, so it ended within that wait.
        assert firsts[0].get(child.pid) == -signal.SIGKILL, firsts
    finally:
        if psutil.pid_exists(child.pid) and child.poll() is None:
            child.kill()
            child.wait()
