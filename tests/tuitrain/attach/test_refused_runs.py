"""A run refused for a mistake in its input is one line and status 2, and no run to list:
it never trained, as one the command line refused before it started never did."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tests.tuitrain.fakeworker import FakeWorker
from tuitrain.cli import main
from tuitrain.errors import EXIT_BAD_INPUT, EXIT_FAILED
from tuitrain.events import Failed
from tuitrain.runs import list_runs
from tuitrain.served import serve
from tuitrain.settings import Settings


def ended_with(failure: Failed) -> None:
    """A served run whose worker ends with `failure` before its first step, followed to
    its end as the headless runner follows one."""
    served = serve(FakeWorker([failure]), Settings(model="tiny"), err=io.StringIO())
    assert served is not None
    served.start()
    assert failure in served.poll()
    served.close()


def test_a_run_refused_for_its_input_is_not_listed(runtime_dir: Path) -> None:
    ended_with(Failed("the corpus holds 8 tokens, fewer than one batch of 2 x 128",
                      exitcode=EXIT_BAD_INPUT))
    assert list_runs(runtime_dir) == []


def test_a_run_that_failed_before_its_first_step_is_still_listed_failed(runtime_dir: Path
                                                                        ) -> None:
    ended_with(Failed("RuntimeError: out of memory", exitcode=EXIT_FAILED))
    [record] = list_runs(runtime_dir)
    assert (record.state, record.step) == ("failed", 0)


@pytest.mark.slow
def test_data_too_short_for_a_batch_is_one_line_status_2_and_no_run(
        capsys, tmp_path: Path, runtime_dir: Path) -> None:
    corpus = tmp_path / "short.txt"
    corpus.write_text("hello world\n")
    assert main(["run", "tiny", "--headless", "--steps", "1", "--data", str(corpus)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = err.splitlines()
    assert line.startswith("tuitrain: error: the corpus holds ")
    assert "fewer than one batch of 2 x 128" in line
    assert main(["runs"]) == 0
    assert list_runs(runtime_dir) == []
    assert "no runs yet" in capsys.readouterr().out


@pytest.mark.slow
def test_with_ranks_data_too_short_is_still_one_line_and_no_rank_leaves_a_log(
        tmp_path: Path, runtime_dir: Path) -> None:
    """Rank 0 says the mistake; the launcher then ends rank 1 with SIGTERM, which stops it
    quietly, its worker's log removed as after any clean end."""
    import subprocess
    import sys
    import tempfile

    corpus = tmp_path / "short.txt"
    corpus.write_text("hello world\n")
    logs = Path(tempfile.gettempdir()) / "tuitrain"
    before = set(logs.glob("rank*-worker-*.log"))
    run = subprocess.run([sys.executable, "-m", "tuitrain", "run", "tiny", "--headless",
                          "--nproc", "2", "--steps", "1", "--data", str(corpus)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith("tuitrain: error: the corpus holds ")
    assert set(logs.glob("rank*-worker-*.log")) <= before
    assert list_runs(runtime_dir) == []
