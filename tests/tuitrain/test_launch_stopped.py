"""A data-parallel launch (`tuitrain run --nproc N`) that was stopped, not failed: Ctrl-C,
which the launcher passes on to its ranks, or a reader of the output that went away, which
rank 0 stops the run for. Its status says so, and it adds no line to those its ranks said:
no traceback, no note of the launcher's own. A rank that failed is still named."""

from __future__ import annotations

import io
import logging
import re
import signal
from pathlib import Path

import pytest
import torch.distributed.launcher.api
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tuitrain import launch


def launch_ending_with(monkeypatch, raised: BaseException) -> tuple[int, str]:
    """launch() over an agent that ends the launch with `raised` after a note of its own
    (the note torch's agent logs when a signal stops it); its status and what it wrote."""
    def elastic_launch(config, entry):
        def run(*args):
            logging.getLogger("torch.distributed.elastic.agent.server.api").warning(
                "Received 2 death signal, shutting down workers")
            raise raised
        return run

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launch, "_adopt_orphans", lambda: False)  # the tests' own process
    err = io.StringIO()
    return launch.launch(2, ["tiny"], batch_size=2, err=err), err.getvalue()


def ranks_ended(tmp_path: Path, *codes: int) -> ChildFailedError:
    return ChildFailedError("tuitrain", {
        rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code,
                             error_file=str(tmp_path / f"error-{rank}.json"))
        for rank, code in enumerate(codes)})


def test_ctrl_c_of_the_launcher_ends_it_with_130_and_no_word_of_its_own(
        monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    status, said = launch_ending_with(
        monkeypatch, SignalException("Process 1 got signal: 2", sigval=signal.SIGINT))
    assert (status, said) == (130, "")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("torch")] == []
    assert logging.getLogger("torch.distributed.elastic.agent.server.api").level != \
        logging.CRITICAL, "the agent's loggers are as they were after the launch"


@pytest.mark.parametrize(("codes", "status"), [((130, 130), 130), ((141,), 141),
                                               ((141, 130), 130)])
def test_ranks_that_stopped_as_asked_are_no_failure(monkeypatch, tmp_path, codes, status):
    assert launch_ending_with(monkeypatch, ranks_ended(tmp_path, *codes)) == (status, "")


def test_a_rank_that_failed_beside_one_that_stopped_is_named(monkeypatch, tmp_path) -> None:
    status, said = launch_ending_with(monkeypatch, ranks_ended(tmp_path, 130, 1))
    assert status != 0 and re.fullmatch(r"tuitrain: rank \d of 2 failed.*\n", said), said
