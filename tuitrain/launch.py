"""`tuitrain run MODEL --nproc N`: the ranks of a data-parallel run on this machine, started
through torchrun's launcher API (torch.distributed.launcher), as `torchrun --standalone
--nproc-per-node N -m tuitrain run MODEL ...` would start them.

Each rank is a `tuitrain run` of its own (tuitrain.ranks says what differs between them);
this process only waits for them and turns their ending into one exit status. What a rank
leaves behind ends with the launch: on Linux this process adopts its ranks' orphans (a
rank's worker that hangs, stopped or stuck, outlives the rank the launcher gave up on) and
kills those still there once every rank has ended.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tuitrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLOSED_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
)
from tuitrain.ranks import Ranks, failure_record
from tuitrain.worker_log import LAUNCH_ENV, remove_rank_logs

MONITOR_SECONDS = 0.2  # how often the launcher looks at its ranks
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants become this process's children
LEFTOVER_GRACE_SECONDS = 2.0
# Set in the environment of the ranks this launcher starts: it has checked the run (the
# model, the files and folders named) on this machine before starting them, so they do not
# check it again. The check imports torch and transformers: seconds of CPU in every rank,
# whose worker then imports them anyway.
CHECKED_ENV = "TUITRAIN_CHECKED_BY_LAUNCHER"
# Set in the environment of the ranks when the launching process saves a preset: the file
# rank 0 writes the settings its run started with to (a Started event's, as JSON), so that
# the preset holds what the run used (the policy the plan chose, the budget resolved).
USED_SETTINGS_ENV = "TUITRAIN_USED_SETTINGS"


def checked_by_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank started by `tuitrain run --nproc`, whose launcher
    checked the run on this machine already (a rank under torchrun checks it itself)."""
    return (os.environ if env is None else env).get(CHECKED_ENV) == "1"


def check_nproc(nproc: int) -> int:
    """`nproc` as given to --nproc: ValueError unless it is a whole number of ranks, at
    least 1 (the one line a user sees)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc: must be a whole number of ranks, at least 1 (got {nproc})")
    return nproc


# Options of `tuitrain run` that are the launcher's, not the ranks': --nproc itself, and
# --save-preset (with --force, which only it reads), which the launching process saves once
# every rank has ended.
_LAUNCHER_OPTIONS = ("--nproc", "--save-preset")
_LAUNCHER_SWITCHES = ("--force",)


def rank_arguments(argv: Sequence[str]) -> list[str]:
    """`tuitrain run`'s arguments as each rank gets them: less --nproc and --save-preset
    (with their values, given as `--opt V` or `--opt=V`) and --force."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LAUNCHER_SWITCHES:
            continue
        elif arg in _LAUNCHER_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _LAUNCHER_OPTIONS)):
            out.append(arg)
    return out


def launch(nproc: int, argv: Sequence[str], *, batch_size: int,
           err: TextIO = sys.stderr) -> int:
    """Run `tuitrain run <argv>` (see rank_arguments) on `nproc` ranks and wait for them.

    Returns 0 when every rank finished; else the rank that failed first is named on `err`
    (each rank has reported why, with its log; see first_failure) and its exit status is
    returned, 2 (bad input, said once by rank 0) when any rank found the input wrong. A run
    stopped is no failure, and adds no line to those its ranks said: 130 after Ctrl-C (the
    launcher passes it on to each rank, which stops as after its own), 141 when the reader of
    the output went away (rank 0 stopped the run).
    `batch_size`, the run's global batch, is checked first (ValueError: it must split over
    the ranks)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_nproc(nproc)
    Ranks(0, nproc).check_batch(batch_size)
    # The installed command, not `python -m tuitrain`: -m puts the working folder first on
    # the path, where a folder named tuitrain (the workers' log folder in /tmp, say) would
    # shadow the package.
    script = Path(sys.executable).with_name("tuitrain")
    entry, prefix = ((str(script), ()) if script.is_file()
                     else (sys.executable, ("-m", "tuitrain")))
    # One thread per rank unless the user chose: ranks share this machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The launcher's folder (each rank's error file: how it failed) is this launch's alone
    # and goes with it; left to itself the launcher makes one in /tmp and leaves it there.
    folder = tempfile.mkdtemp(prefix="tuitrain-launch-")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # a free port, as --standalone
        max_restarts=0, monitor_interval=MONITOR_SECONDS,
        logs_specs=DefaultLogsSpecs(log_dir=folder))
    # The launcher's own notes (a rank failed, the others are stopped, a Ctrl-C passed on)
    # repeat what the ranks report themselves, and the exit status says. Its modules' loggers
    # each have a level of their own, so each is quietened, not only their parent.
    agents = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
              if name == "torch.distributed.elastic"
              or name.startswith("torch.distributed.elastic.")]
    levels = [agent.level for agent in agents]
    for agent in agents:
        agent.setLevel(logging.CRITICAL)
    before = _children() if _adopt_orphans() else None
    # What this process imported (torch, and transformers for the checks) lives until it
    # exits: the collector need not walk it again, nor at the exit once the ranks ended
    # (seconds of a loaded machine's CPU between the last line and the exit status).
    gc.freeze()
    os.environ[CHECKED_ENV] = "1"  # the ranks inherit this process's environment
    launch_id = os.environ[LAUNCH_ENV] = config.run_id[:8]
    try:
        elastic_launch(config, entry)(*prefix, "run", *argv)
    except ChildFailedError as error:
        codes = [f.exitcode for f in error.failures.values()]
        if EXIT_BAD_INPUT in codes:
            remove_rank_logs(launch_id)
            return EXIT_BAD_INPUT  # a mistake in the input: rank 0 has said it, in one line
        stopped = {EXIT_INTERRUPTED, EXIT_CLOSED_PIPE, EXIT_TERMINATED}
        if set(codes) <= stopped:  # stopped, as rank 0 said (SIGTERM: the launcher's)
            remove_rank_logs(launch_id)
            return EXIT_INTERRUPTED if EXIT_INTERRUPTED in codes else max(codes)
        rank, failure = first_failure(error.failures)
        exitcode = ended_with(failure)
        err.write(f"tuitrain: {failure_line(rank, exitcode, nproc, len(codes) - 1)}\n")
        return exitcode if exitcode > 0 else EXIT_FAILED
    except SignalException as error:
        # Ctrl-C (or a kill) of this process: the launcher has passed it on to the ranks
        # (each in a session of its own, out of the terminal's reach), waited for them to
        # stop, and raises it. Each rank has said how it ended.
        remove_rank_logs(launch_id)
        return 128 + int(error.sigval)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(CHECKED_ENV, None)
        os.environ.pop(LAUNCH_ENV, None)
        for agent, level in zip(agents, levels, strict=True):
            agent.setLevel(level)
        if before is not None:
            _end_leftovers(before)
    return 0


def _adopt_orphans() -> bool:
    """Make this process the subreaper of what it starts (Linux), so that a rank's worker
    whose rank ended becomes its child instead of init's; False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _children() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children()}


def _end_leftovers(before: set[int]) -> None:
    """Reap the processes that became this process's children during the launch: the
    ranks' orphans, which every rank having ended leaves with nothing to do. Those that do
    not end by themselves within LEFTOVER_GRACE_SECONDS (a resource tracker finishing its
    cleanup does) are killed: SIGKILL, since a stopped process ignores anything else. A
    stopped one (a hung rank's worker, kill -STOP) is killed at once: it cannot end by
    itself, so waiting for it would only hold the launcher."""
    import psutil

    left = [child for child in psutil.Process().children() if child.pid not in before]
    for child in left:
        try:
            if child.status() == psutil.STATUS_STOPPED:
                child.kill()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(left, timeout=LEFTOVER_GRACE_SECONDS)
    for child in left:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)


def first_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """(rank, its ProcessFailure) of the rank that failed first, of `failures` (a
    ChildFailedError's, rank -> ProcessFailure).

    One rank failing makes the others fail a moment later (their collectives lose it) or
    be stopped by the launcher (SIGTERM), so the first is, in this order: a rank whose
    worker was killed by a signal (the out-of-memory killer, kill -9) or that was itself
    killed by one other than the launcher's SIGTERM; then the rank that saw its failure
    first, by the time it recorded (ranks.record_failure); then one that ended by itself
    without saying when; then, when every rank was ended by SIGTERM, the first seen."""
    def order(item: tuple[int, Any]) -> tuple:
        rank, failure = item
        record = failure_record(failure.error_file_data)
        if record is not None:
            return (not record.killed, 0, record.at, rank)
        killed = failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
        by_itself = killed or failure.exitcode > 0
        return (not killed, 1 if by_itself else 2, float(failure.timestamp), rank)

    return min(failures.items(), key=order)


def ended_with(failure: Any) -> int:
    """The exit status of a rank's end (a ProcessFailure): the one it recorded when it failed
    by itself, where the launcher's SIGTERM (sent because another rank, which its own
    failure had made fail, ended first) came before its own exit; else the process's."""
    record = failure_record(failure.error_file_data)
    if record is not None and failure.exitcode == -signal.SIGTERM:
        return record.exitcode
    return failure.exitcode


def failure_line(rank: int, exitcode: int, nproc: int, others: int) -> str:
    """"rank 1 of 2 failed first (exit status 1); the other rank was stopped because of
    it": the rank that failed first, how it ended, and how many other ranks did not finish
    because of it."""
    if exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exit status {exitcode}"
    if not others:
        return f"rank {rank} of {nproc} failed ({how})"
    rest = "the other rank was" if others == 1 else f"the other {others} ranks were"
    return f"rank {rank} of {nproc} failed first ({how}); {rest} stopped because of it"
