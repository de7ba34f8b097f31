"""How each of a calibration's measurements is timed: `_Clock` shares the time limit out
among them, and each repeats until its share is spent.

A figure measured once stands for every later forecast on the machine, and a machine shared
with other work slows a measurement at random moments. So a kernel's rate is its fastest run
(what the machine does when nothing else takes its cores), and what a step of many runs
takes is their median (`typical`). On the simulated device the runs are timed by the
measuring thread's CPU seconds, which load stretches far less than the wall clock; of those,
the fastest counts only among the runs that clock saw whole (`whole_runs`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["WHOLE", "whole_runs"]


class _Clock:
    """Shares the time limit out: each measurement repeats until its share is spent.

    Timed by `timer`: on the simulated device the measuring thread's CPU seconds, which are
    a kernel's duration on a quiet machine (that thread is OpenMP's thread 0 in every
    parallel kernel) and which a loaded one, taking the cores away between its slices,
    stretches far less than the wall clock. A GPU's kernels run while it waits: wall."""

    def __init__(self, limit: float, shares: int,
                 timer: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self.share = limit / shares
        self.deadline = time.perf_counter() + limit
        self.timer, self.wall = timer, wall

    def rate(self, work: float, run: Callable[[], None], sync: Callable[[], None], *,
             typical: bool = False, runs: int = 3, shares: float = 1.0) -> float:
        """`work` per second of `run`'s fastest run of `times`. The fastest: what the
        machine does when nothing else takes its cores, which a busy moment during the
        measurement must not change for every later forecast. `typical`: the median run
        instead, what a step of many such runs takes (the median of its steps is what a
        run's step time is judged by)."""
        times = self.times(run, sync, runs=runs, shares=shares, whole=not typical)
        return work / max(statistics.median(times) if typical else min(times), 1e-9)

    def times(self, run: Callable[[], None], sync: Callable[[], None], *, runs: int = 3,
              shares: float = 1.0, whole: bool = False) -> list[float]:
        """The seconds of `run`'s runs, as many as `shares` shares allow (one warm-up
        excluded; at least `runs` unless the whole limit is spent); `whole`: only those the
        timer saw whole (`whole_runs`), as the fastest of them must be."""
        run()
        sync()
        times: list[float] = []
        walls: list[float] = []
        start = time.perf_counter()
        while not times or (
                (len(times) < runs or time.perf_counter() - start < self.share * shares)
                and len(times) < 50 and time.perf_counter() < self.deadline):
            t0, w0 = self.timer(), self.wall()
            run()
            sync()
            times.append(self.timer() - t0)
            walls.append(self.wall() - w0)
        return whole_runs(times, walls) if whole else times


# A run timed by the measuring thread's clock counts where that clock ran for at least this
# share of the wall clock's time (whole_runs).
WHOLE = 0.8


def whole_runs(seconds: list[float], walls: list[float]) -> list[float]:
    """The runs (`seconds` by the measuring thread's clock, `walls` by the wall clock's)
    that the thread's clock saw whole. A parallel kernel's thread 0, done with its part
    first, waits at the kernel's end for the others, and where one of them was held up (a
    core taken by another job) it sleeps there, its clock stopped: that run reads faster
    than the kernel ran (seen here: of 300 runs of the elementwise probe, some took up to
    3.1x by the wall clock what they took by the thread's), and the fastest run is what a
    rate keeps. So where the fastest run is taken, a run counts only where the thread's
    clock kept up with the wall clock (WHOLE); if none did (a machine busy throughout), all
    do: the thread's clock is still what load stretches least. Timed by the wall clock
    alone (a GPU), every run counts."""
    whole = [s for s, w in zip(seconds, walls, strict=True) if s >= WHOLE * w]
    return whole or seconds
