"""DataParallelWorker: the ranks of a data-parallel run on this machine, seen by the UI as
one worker.

It spawns one worker process per rank (tuitrain.worker.ProcessWorker), each told its place
through torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT on this machine), so each joins the others as under `torchrun` (tuitrain.ranks).
As torchrun's agent does, this process hosts the rendezvous store, listening on a port the
system chose and held from the start (TORCHELASTIC_USE_AGENT_STORE: every rank connects to
it): no port is picked, released and bound again, which another program could take between.
Every rank has its own pair of pipes, so the death of any one is seen at once.

- Events: rank 0's pass through as they are (its Started, Step, Log, answers, Finished); the
  other ranks' steps come as RankStep, so the UI can show every rank's memory. Rank 0 does
  not gather them: each rank's own pipe carries them, which costs no collective and goes on
  reporting while a rank waits for the others.
- Commands go to rank 0, which decides at a step boundary and tells the others
  (tuitrain.run_commands): a change's answer names the step every rank took it at.
- Failure: the first rank to fail is reported (a rank that died by itself before the ranks
  it left stuck in a collective), as a Failed that names it; the others are ended at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path

from engine.telemetry import StepStats
from tuitrain.events import Command, Event, Failed, Finished, Log, RankStep, Started, Step, Stop
from tuitrain.ranks import LOCAL_RANK_ENV, RANK_ENV, WORLD_ENV
from tuitrain.settings import Settings
from tuitrain.worker import ProcessWorker
from tuitrain.worker_log import default_log_path

# The rendezvous: this process's store, on this machine's loopback.
MASTER_ADDR = "127.0.0.1"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # ranks connect to a store already there
# How long a rank waits for the store (torch's default rendezvous timeout).
STORE_TIMEOUT = datetime.timedelta(minutes=30)
# Ranks share this machine's cores: one thread each unless the user chose (as tuitrain.launch).
DEFAULT_THREADS = "1"
# A rank's own report of a failure waits this long for the death of a peer that caused it
# (a rank killed from outside leaves the others failing in a collective a moment later).
FAILURE_GRACE_SECONDS = 1.0


class DataParallelWorker:
    """Trains `settings` on `nproc` ranks of this machine; implements
    `tuitrain.client.WorkerClient`.

    Args:
        settings: the run; `training.batch_size` is the global batch (a multiple of nproc).
        nproc: how many ranks, at least 2.
        log_dir: where each rank's log goes (`rank<R>-...log`); default the temporary folder,
            where a rank's log is removed once it ended cleanly (tuitrain.worker).

    Like ProcessWorker it keeps `latest`, `history`, `started` (rank 0's) and `result`.
    """

    def __init__(self, *, settings: Settings, nproc: int, log_dir: str | os.PathLike | None = None):
        if nproc < 2:
            raise ValueError(f"a data-parallel run needs at least 2 ranks, not {nproc}")
        self.settings = settings
        self.nproc = nproc
        default = default_log_path()
        folder = Path(log_dir) if log_dir is not None else default.parent
        self.log_paths = [folder / f"rank{r}-{default.name}" for r in range(nproc)]
        self._own_logs = log_dir is None
        self.ranks: list[ProcessWorker] = []
        self.result: Finished | Failed | None = None
        self._failures: list[tuple[int, Failed, float]] = []  # (rank, failure, when seen)
        self._store = None  # the rendezvous store, held while the ranks run

    # --- WorkerClient --------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every rank; returns at once (rank 0 reports `Started` once all joined)."""
        if self.ranks:
            raise RuntimeError("these ranks were already started")
        self._store = _rendezvous_store()
        port = self._store.port
        threads = os.environ.get("OMP_NUM_THREADS", DEFAULT_THREADS)
        for rank in range(self.nproc):
            environment = {
                WORLD_ENV: str(self.nproc),
                RANK_ENV: str(rank),
                LOCAL_RANK_ENV: str(rank),
                "MASTER_ADDR": MASTER_ADDR,
                "MASTER_PORT": str(port),
                AGENT_STORE_ENV: "True",
                "OMP_NUM_THREADS": threads,
            }
            settings = self.settings
            if rank:  # rank 0 writes the run's files (as under torchrun, tuitrain.headless)
                settings = settings.model_copy(
                    update={"logging": settings.logging.model_copy(update={"metrics": None})})
            worker = ProcessWorker(settings=settings, log_path=self.log_paths[rank],
                                   environment=environment, own_log=self._own_logs)
            worker.start()
            self.ranks.append(worker)

    def send(self, command: Command) -> int:
        """Rank 0 takes every command and answers it for all ranks."""
        if not self.ranks:
            raise RuntimeError("start the ranks before sending commands")
        if isinstance(command, Stop):
            # Also to the others, so that a rank 0 stuck in a step its peers never reach
            # does not hold them: any rank asking stops all at their next boundary.
            for worker in self.ranks[1:]:
                worker.send(command)
        return self.ranks[0].send(command)

    def poll(self) -> list[Event]:
        """Rank 0's events and the others' steps; a failure of any rank as one Failed
        naming it, after which the other ranks are ended."""
        events: list[Event] = []
        for rank, worker in enumerate(self.ranks):
            for event in worker.poll():
                if isinstance(event, Failed):
                    self._failures.append((rank, event, time.monotonic()))
                elif rank == 0:
                    events.append(event)
                elif isinstance(event, Step):
                    events.append(RankStep(rank, event.stats))
                elif isinstance(event, Log) and event.level == "error":
                    events.append(Log(f"rank {rank}: {event.message}", event.level))
        if self.result is None and self._failures and self._decided():
            events.append(self._fail())
        if isinstance(self.result, Failed):
            return [e for e in events if not isinstance(e, Finished)]
        if self.result is None:
            self.result = next((e for e in events if isinstance(e, Finished)), None)
        return events

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every rank to stop at the same step boundary, wait up to `timeout` for all,
        then end the ones left. Idempotent; events that arrive meanwhile are kept."""
        for worker in self.ranks:
            if worker.alive and worker.result is None:
                worker.send(Stop())
        # Rank 0 first: it writes the outputs; the others end with it, or are ended.
        for worker in self.ranks:
            worker.stop(timeout)
        self._store = None  # every rank has ended: the port is free again

    @property
    def alive(self) -> bool:
        return any(worker.alive for worker in self.ranks)

    # --- beyond the protocol -------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """Rank 0's log: the one the run's messages are in."""
        return self.log_paths[0]

    @property
    def started(self) -> Started | None:
        return self.ranks[0].started if self.ranks else None

    @property
    def latest(self) -> StepStats | None:
        return self.ranks[0].latest if self.ranks else None

    @property
    def pids(self) -> list[int | None]:
        return [worker.pid for worker in self.ranks]

    # --- internals -----------------------------------------------------------------------

    def _decided(self) -> bool:
        """Whether the failures seen so far tell which rank failed first."""
        first = min(seen for _, _, seen in self._failures)
        return (any(_killed(failed) for _, failed, _ in self._failures)
                or time.monotonic() - first >= FAILURE_GRACE_SECONDS
                or not self.alive)

    def _fail(self) -> Failed:
        """The failure to report, naming its rank; the other ranks are ended."""
        rank, failed, _ = min(self._failures, key=lambda f: (not _killed(f[1]), f[2], f[0]))
        others = [r for r, worker in enumerate(self.ranks) if r != rank and worker.alive]
        for r in others:
            self.ranks[r].terminate(f"rank {rank} failed")
        reason = failed.reason
        if len(others) == 1:
            reason += "; the other rank was stopped"
        elif others:
            reason += f"; the other {len(others)} ranks were stopped"
        elif len(self.ranks) == 2:  # it had failed already, in a collective waiting for this
            reason += "; the other rank ended with it"
        else:
            reason += "; the other ranks ended with it"
        self.result = dataclasses.replace(failed, reason=reason, rank=rank,
                                          log_path=str(self.log_paths[rank]))
        return self.result


def _killed(failed: Failed) -> bool:
    """Whether a rank was killed by a signal (kill -9, the out-of-memory killer): the cause,
    the others then fail in a collective waiting for it."""
    return failed.exitcode is not None and failed.exitcode < 0


def _rendezvous_store():
    """A TCP store listening on the loopback, on a port the system chose (its `.port`)."""
    from torch.distributed import TCPStore

    return TCPStore(MASTER_ADDR, 0, is_master=True, wait_for_workers=False,
                    timeout=STORE_TIMEOUT)
