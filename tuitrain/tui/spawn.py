"""How the app gets its worker: the factory type, the real one, and a safe way to start it."""

from __future__ import annotations

from collections.abc import Callable

from tuitrain.client import WorkerClient
from tuitrain.settings import Settings
from tuitrain.stop_requests import sighup_held

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
    """Build a worker and start it (ProcessWorker.start copes with Textual's stderr), its
    processes with SIGHUP held back (stop_requests.sighup_held): after a hangup, the app
    stops the run (tuitrain.tui.termination)."""
    worker = factory(settings)
    with sighup_held():
        worker.start()
    return worker
