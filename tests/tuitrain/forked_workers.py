"""The application's worker processes, forked from the tests' fork server (tests/forked.py)
instead of spawned.

A spawned worker spends seconds of the machine's CPU importing torch and transformers
before its first step; every real run in these tests starts one, and a data-parallel run
one per rank. A forked worker starts from the server's copy of those imports. The child is
otherwise the one the product starts (`tuitrain.worker_main.worker_main`, the same
arguments, pipes and environment); tests/conftest.py puts `ForkedContext` in
`tuitrain.worker.CONTEXT` for every test, and a test of the real spawn starts its worker
inside `spawned()`.

What differs, and how it is made up for:
- The environment: the server's, from when it started; the child takes the test's as it
  was when the worker started (tests.forked.adopt), as a spawned child inherits it.
- The parent: the server, not the test process. The worker watches the test process
  through multiprocessing's parent sentinel, as a spawned one does; the pid it also
  checks is the server's, which outlives every worker.
- Threads: torch read OMP_NUM_THREADS when the server imported it, so a count the worker's
  environment names (a rank's) is set again, as a spawned child's import would read it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from tests.forked import adopt, context
from tuitrain import worker


class ForkedContext:
    """The part of a multiprocessing context that `tuitrain.worker.ProcessWorker` uses."""

    def Pipe(self, duplex: bool = True) -> tuple[Connection, Connection]:  # noqa: N802
        return context().Pipe(duplex)

    def Process(self, *, target: Callable[..., None], name: str, kwargs: dict[str, Any],  # noqa: N802
                daemon: bool) -> BaseProcess:
        return context().Process(target=_forked_worker, name=name, daemon=daemon,
                                 args=(target, dict(os.environ)), kwargs=kwargs)


def _forked_worker(target: Callable[..., None], environ: dict[str, str], **kwargs: Any) -> None:
    adopt(environ)
    threads = (kwargs.get("environment") or {}).get("OMP_NUM_THREADS",
                                                    environ.get("OMP_NUM_THREADS"))
    if threads:
        import torch  # already imported by the server

        torch.set_num_threads(int(threads))
    target(**{**kwargs, "parent_pid": os.getppid()})


@contextlib.contextmanager
def spawned() -> Iterator[None]:
    """Workers started inside this block are spawned, as the product starts them."""
    forked = worker.CONTEXT
    worker.CONTEXT = multiprocessing.get_context("spawn")
    try:
        yield
    finally:
        worker.CONTEXT = forked


def worker_processes() -> list[psutil.Process]:
    """The worker processes running under this test process, spawned or forked: its
    descendants less multiprocessing's helpers (the resource tracker, and the fork server,
    which lives as long as the test process; the workers it forked are counted)."""
    me = os.getpid()
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
            server = "forkserver" in line and child.ppid() == me
            if "resource_tracker" not in line and not server:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found
