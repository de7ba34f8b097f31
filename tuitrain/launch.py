"""`tuitrain run MODEL --nproc N`: the ranks of a data-parallel run on this machine, started
through torchrun's launcher API (torch.distributed.launcher), as `torchrun --standalone
--nproc-per-node N -m tuitrain run MODEL ...` would start them.

Each rank is a `tuitrain run` of its own (tuitrain.ranks says what differs between them);
this process only waits for them and turns their ending into one exit status.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Sequence
from typing import TextIO

from tuitrain.errors import EXIT_BAD_INPUT, EXIT_FAILED

MONITOR_SECONDS = 0.2  # how often the launcher looks at its ranks


def check_nproc(nproc: int) -> int:
    """`nproc` as given to --nproc: ValueError unless it is a whole number of ranks, at
    least 1 (the one line a user sees)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a whole number of ranks, at least 1, not {nproc!r}")
    return nproc


# Options of `tuitrain run` that are the launcher's, not the ranks': --nproc itself, and
# --save-preset, which the launching process saves once every rank has ended.
_LAUNCHER_OPTIONS = ("--nproc", "--save-preset")


def rank_arguments(argv: Sequence[str]) -> list[str]:
    """`tuitrain run`'s arguments as each rank gets them: less --nproc and --save-preset
    (with their values, given as `--opt V` or `--opt=V`)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LAUNCHER_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _LAUNCHER_OPTIONS)):
            out.append(arg)
    return out


def launch(nproc: int, argv: Sequence[str], *, batch_size: int,
           err: TextIO = sys.stderr) -> int:
    """Run `tuitrain run <argv>` (see rank_arguments) on `nproc` ranks and
    wait for them; returns 0 when every rank finished, else the exit status of the rank
    that failed first, named on `err` (its own report names its log). `batch_size`, the
    run's global batch, is checked first (ValueError: it must split over the ranks)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tuitrain.ranks import Ranks

    check_nproc(nproc)
    Ranks(0, nproc).check_batch(batch_size)
    # One thread per rank unless the user chose: ranks share this machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # a free port, as --standalone
        max_restarts=0, monitor_interval=MONITOR_SECONDS)
    # The launcher's own notes (a rank failed, the others are stopped) repeat what the
    # ranks report themselves, and the exit status says.
    agent = logging.getLogger("torch.distributed.elastic")
    level, agent.level = agent.level, logging.CRITICAL
    try:
        elastic_launch(config, sys.executable)("-m", "tuitrain", "run", *argv)
    except ChildFailedError as error:
        # The first to fail by itself: the others were stopped because it did (SIGTERM).
        rank, failure = min(error.failures.items(),
                            key=lambda item: (item[1].exitcode <= 0, item[1].timestamp))
        code = failure.exitcode if failure.exitcode > 0 else EXIT_FAILED
        if code == EXIT_BAD_INPUT:
            return code  # a mistake in the input: rank 0 has said it, in one line
        err.write(f"tuitrain: rank {rank} of {nproc} failed (exit status {failure.exitcode}); "
                  f"the other ranks were stopped\n")
        return code
    finally:
        agent.setLevel(level)
    return 0
