"""How the app gets its worker: the factory type, the real one, and a safe way to start it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from tuitrain.client import WorkerClient
from tuitrain.settings import Settings

WorkerFactory = Callable[[Settings], WorkerClient]


def default_worker_factory(settings: Settings) -> WorkerClient:
    """A real worker process; it logs under the temporary folder and says where in Started."""
    from tuitrain.worker import ProcessWorker  # spawns the engine; only needed for real runs

    return ProcessWorker(settings=settings)


def start_worker(factory: WorkerFactory, settings: Settings) -> WorkerClient:
    """Build a worker and start it from inside the running app.

    Textual swaps sys.stderr for a capture whose fileno() is -1, and multiprocessing hands
    stderr's descriptor to the resource-tracker process it starts with the first spawn,
    which fails on -1. So the start sees a real file as stderr: the null device, because the
    tracker only ever writes leak warnings and they must not scribble over the screen.
    """
    worker = factory(settings)
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        worker.start()
    return worker
