"""How the app gets its worker: the factory type, the real one, and a safe way to start it."""

from __future__ import annotations

import signal
from collections.abc import Callable

from tuitrain.client import WorkerClient
from tuitrain.settings import Settings

WorkerFactory = Callable[[Settings], WorkerClient]


def default_worker_factory(settings: Settings) -> WorkerClient:
    """A real worker process; it logs under the temporary folder and says where in Started."""
    from tuitrain.worker import ProcessWorker  # spawns the engine; only needed for real runs

    return ProcessWorker(settings=settings)


def data_parallel_factory(nproc: int) -> WorkerFactory:
    """Workers that train on `nproc` ranks of this machine, seen as one (rank 0 steered)."""

    def factory(settings: Settings) -> WorkerClient:
        from tuitrain.rank_worker import DataParallelWorker

        return DataParallelWorker(settings=settings, nproc=nproc)

    return factory


def start_worker(factory: WorkerFactory, settings: Settings) -> WorkerClient:
    """Build a worker and start it (ProcessWorker.start copes with Textual's stderr).

    Its processes start with SIGHUP held back, a mask they keep through exec: a terminal
    that goes away signals every process of the app's job, and it is the app that then
    stops the run (tuitrain.tui.termination), with its summary and without the log that a
    worker the hangup ended would leave. This thread holds the signal only while the
    processes start, and takes it after, if another of the app's threads has not.
    """
    worker = factory(settings)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        worker.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return worker
