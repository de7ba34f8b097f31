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
from pathlib import Path
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
    """Run `tuitrain run <argv>` (see rank_arguments) on `nproc` ranks and wait for them.

    Returns 0 when every rank finished; else the ranks that failed are named on `err`
    (each has reported why, with its log) and the first one's exit status is returned, 2
    (bad input, said once by rank 0) when any rank found the input wrong. `batch_size`,
    the run's global batch, is checked first (ValueError: it must split over the ranks)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tuitrain.ranks import Ranks

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
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # a free port, as --standalone
        max_restarts=0, monitor_interval=MONITOR_SECONDS)
    # The launcher's own notes (a rank failed, the others are stopped) repeat what the
    # ranks report themselves, and the exit status says.
    agent = logging.getLogger("torch.distributed.elastic")
    level = agent.level
    agent.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, entry)(*prefix, "run", *argv)
    except ChildFailedError as error:
        # Ranks that ended by themselves failed; the launcher stopped the rest (SIGTERM).
        failed = sorted((r, f.exitcode) for r, f in error.failures.items() if f.exitcode > 0)
        if not failed:  # every rank was ended by a signal from outside
            failed = sorted((r, f.exitcode) for r, f in error.failures.items())
        if any(code == EXIT_BAD_INPUT for _, code in failed):
            return EXIT_BAD_INPUT  # a mistake in the input: rank 0 has said it, in one line
        ranks = ", ".join(f"rank {r} (exit status {code})" for r, code in failed)
        rest = nproc - len(failed)
        err.write(f"tuitrain: {ranks} of {nproc} failed"
                  + (f"; the other {rest} were stopped" if rest else "") + "\n")
        return failed[0][1] if failed[0][1] > 0 else EXIT_FAILED
    finally:
        agent.setLevel(level)
    return 0
