"""The reference decoder: a real decoder's forward and backward, timed at two depths against
what the calibration's rates forecast for it (`_Reference`).

Kernels measured alone at their best do not show the small matmuls, the barriers between a
parallel kernel's threads or the dispatch of each op. The slope between the two depths is
the compute factor that a step's kernels are multiplied by, and what the shallow decoder
took beyond it an offset per micro-batch (engine.planning.speeds.Calibration
.compute_seconds); in fp32 and in the half precision runs here default to.

On the simulated device the same decoders also run in a process of their own whose heap
maps nothing afresh (`_KeptDecoder`), each round beside this process's: the kept runs are
the kernels alone, which the factor is fitted on, and the difference is what the new memory
of a step's activations costs (`activation_pages`).
"""

from __future__ import annotations

import contextlib
import json
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.devices.host_memory import mapped_from
from engine.planning.speeds import DTYPES

if TYPE_CHECKING:
    from engine.planning.clock import _Clock
    from engine.planning.flops import StepWork
    from engine.planning.speeds import Calibration

__all__ = [
    "ACTIVATION_BOUNDS",
    "CUDA_REFERENCE",
    "KEPT_LIMIT",
    "KEPT_WAIT",
    "REFERENCE",
    "REFERENCE_RUNS",
    "REFERENCE_SHARES",
    "SLOPE_BOUNDS",
    "kept_decoder",
]

# The decoder the compute factor is measured on: opt-125m's layers at a batch of 2 x 128
# with a small vocabulary (so that its head does not dominate), at two depths. Why two:
# the slope between the depths is what a layer adds, and the shallow decoder's rest is an
# offset per micro-batch. On the simulated device the factor is fitted on the decoder in a
# kept heap (_KeptDecoder), which takes no new memory: there such decoders ran at one factor
# from 1 to 12 layers, at either vocabulary (1.08-1.14x the rates' forecast on 2026-12-04,
# 1.29-1.31 on 2026-12-05's machine), with an offset near nothing. The steady heap's runs
# beside it price the new memory (`activation_pages`). Fitted on the steady heap's runs
# alone, their new memory taken off at the probe's rate, the factor moved from 1.14 to
# 1.41 between calibrations of one afternoon, and the forecasts of a grid with it.
REFERENCE = {"model": "opt-125m", "layers": (1, 6), "vocab": 8192, "batch": 2, "seq_len": 128}
# On a GPU, opt-1.3b's layers at 4 x 1024: opt-125m's at 2 x 128 are launch-bound there and
# measured a factor of 3.6 (fp32) and 7.1 (bf16) on an H200, which multiplied every
# model's arithmetic, opt-1.3b's too (2.91 s forecast, 0.20 s measured). Three layers deep
# at most: both precisions' decoders are held at once, and a laptop's 6 GB must hold them
# with one run's activations (by count about half a GB a layer in fp32 at this batch; not
# yet measured on a GPU).
CUDA_REFERENCE = {"model": "opt-1.3b", "layers": (1, 3), "vocab": 8192, "batch": 4,
                  "seq_len": 1024}
# Its median run at each depth, the two taken in turn, of at least REFERENCE_RUNS in each of
# two windows that take REFERENCE_SHARES between them: one run moves by a quarter from one
# moment to the next here, and the fastest of a few is the luckiest, not what a step takes.
REFERENCE_RUNS = 3
REFERENCE_SHARES = 12
# The fitted factor stays within these multiples of the deep decoder's own (its run over its
# forecast): two depths a few runs each can disagree by a slow spell, and a slope from them
# alone could then make a layer cost nothing, or twice what it does.
SLOPE_BOUNDS = (0.5, 2.0)


class _Reference:
    """A real decoder's forward and backward (REFERENCE, or CUDA_REFERENCE on a GPU; plain
    PyTorch, no engine, no generation cache, as the engine runs a model) at two depths,
    timed in turn in two windows, one before the kernels and one after them: on a shared
    machine a slow spell lasts seconds (the same decoder ran 220 ms, then 370 ms, then 260
    ms a run here, each for several seconds), so that one spell is one window of two, and
    it slows both depths alike. `fit`: the factor and the offset that turn the calibration's
    forecast for the FLOPs and bytes (engine.planning.flops) of each depth into its median
    run. The rates are each kernel's fastest and these are medians, so the factor also
    carries how far a typical step of many kernels falls behind their best."""

    def __init__(self, where: torch.device, sync: Callable[[], None], scale: float,
                 precision: str = "fp32", shape: dict | None = None,
                 kept: _KeptDecoder | None = None) -> None:
        from transformers import AutoModelForCausalLM

        from engine.models.training import prepare_for_training
        from engine.models.zoo import model_config

        shape = shape or REFERENCE
        self.configs, self.models = [], []
        for layers in shape["layers"]:
            config = model_config("tiny" if scale < 1.0 else shape["model"])
            config.num_hidden_layers = layers
            config.vocab_size = min(config.vocab_size, shape["vocab"])
            with torch.random.fork_rng(devices=[]):  # the run's random numbers stay untouched
                model = AutoModelForCausalLM.from_config(config).to(
                    where, DTYPES[precision]).train()
            prepare_for_training(model)
            self.configs.append(config)
            self.models.append(model)
        self.sync = sync
        self.batch, self.seq = shape["batch"], max(8, int(shape["seq_len"] * scale))
        self.ids = torch.zeros(self.batch, self.seq, dtype=torch.long, device=where)
        self.precision = precision
        self.runs: tuple[list[float], list[float]] = ([], [])  # shallow, deep
        self.kept_decoder = kept
        self.kept: tuple[list[float], list[float]] = ([], [])  # the same in a kept heap
        self.beyond: list[list[float]] = []  # each window's deep runs less their kept pairs
        self.shares = REFERENCE_SHARES * (2 if kept is not None else 1)
        self._work: list[StepWork] = []

    def _run(self, model: torch.nn.Module) -> None:
        model(input_ids=self.ids, labels=self.ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def run_each(self, timer: Callable[[], float]) -> list[float]:
        """`timer`'s seconds of one run of each depth, in turn."""
        seconds = []
        for model in self.models:
            start = timer()
            self._run(model)
            self.sync()
            seconds.append(timer() - start)
        return seconds

    def time(self, clock: _Clock) -> None:
        """One window: half of its `shares` of `clock`'s time, each depth in turn, and
        after them the kept decoder's (each pair of runs in the same moment)."""
        timed: tuple[list[float], ...] = ([], [], [], [])  # shallow, deep, and kept

        def both() -> None:
            for runs, seconds in zip(timed, self.run_each(clock.timer), strict=False):
                runs.append(seconds)
            if self.kept_decoder is not None:
                kept = self.kept_decoder.run()
                if kept is None:  # it failed: these runs are fitted alone
                    self.kept_decoder = None
                    self.kept, self.beyond = ([], []), []
                    return
                for runs, seconds in zip(timed[2:], kept, strict=True):
                    runs.append(seconds)

        with torch.random.fork_rng(devices=[]):  # its dropout draws none of the run's
            clock.times(both, self.sync, runs=REFERENCE_RUNS, shares=self.shares / 2)
        if self.kept_decoder is None:
            timed = timed[:2]
        for runs, window in zip(self.runs + self.kept, timed, strict=False):
            runs += window[1:]  # the first ran to warm up
        if self.kept_decoder is not None:
            self.beyond.append([s - k for s, k in zip(timed[1][1:], timed[3][1:], strict=True)])

    def _works(self) -> list[StepWork]:
        from engine.planning.flops import step_work

        self._work = self._work or [
            step_work(config, DTYPES[self.precision], batch_size=self.batch, seq_len=self.seq,
                      checkpointing=False, mapped_from=mapped_from())
            for config in self.configs]
        return self._work

    def activation_pages(self, cal: Calibration) -> float:
        """Bytes per second of the deep decoder's new memory: its bytes (engine.planning
        .flops: the tensors new in this process's heap) over what its runs took beyond the
        kept decoder's, the median of the pairs run in turn in the last window, within
        ACTIVATION_BOUNDS of the probe's rate. 0 where no kept decoder ran beside it (the
        probe's rate stands).

        The last window alone: in the first, run seconds after the models were built, this
        process's runs took up to twice what they took later (opt-125m's width at 6
        layers: 0.47-0.78 s, then 0.37-0.41 as in a loop of its own, with its new pages
        faulted in alike), where the kept decoder's took 0.30 s throughout (2026-12-05)."""
        fresh = self._works()[1]
        nbytes = fresh.forward_fresh + fresh.backward_fresh
        if not self.beyond or not self.beyond[-1] or nbytes <= 0 or cal.fresh_pages <= 0:
            return 0.0
        took = statistics.median(self.beyond[-1])
        low, high = (bound * cal.fresh_pages for bound in ACTIVATION_BOUNDS)
        return high if took <= nbytes / high else max(low, nbytes / took)

    def fit(self, cal: Calibration) -> tuple[float, float]:
        """(factor, offset): a micro-batch of forward and backward whose kernels the rates
        forecast at k seconds takes factor x k + offset (engine.planning.time_model), its
        new memory apart: fitted on the kept decoder's runs, which take no new memory,
        where it ran; else on these, their new memory taken off at its price."""
        kept = all(self.kept)
        points = []
        for work, runs, kept_runs in zip(self._works(), self.runs, self.kept, strict=True):
            # New memory is priced at its own measured rate, not scaled by the factor: the
            # tensors new in this process's heap.
            points.append((_kernels(cal, work, self.precision),
                           statistics.median(kept_runs) if kept else
                           _less_fresh(statistics.median(runs), _fresh(cal, work))))
        (shallow, shallow_run), (deep, deep_run) = points
        own = _factor(deep_run, 0.0, deep)
        if deep <= shallow:
            return own, 0.0
        low, high = SLOPE_BOUNDS
        slope = min(high * own, max(low * own, (deep_run - shallow_run) / (deep - shallow)))
        return slope, shallow_run - slope * shallow


# The activations' rate of new memory stays within these multiples of the probe's: a pair of
# runs that a slow spell split could make it cost nothing, or more than it costs written
# alone. Measured here: 0.8-1.8x.
ACTIVATION_BOUNDS = (0.5, 4.0)
KEPT_WAIT = 60.0  # seconds the kept decoder may take to answer before it counts as failed
# The shortest time limit a calibration starts the kept decoder in: its imports take seconds.
KEPT_LIMIT = 10.0


class _KeptDecoder:
    """The reference's decoders in a process of their own whose heap maps nothing afresh
    (engine.devices.host_memory.kept_heap), run on request, so that the decoder in this
    process's heap and in a kept one are timed at the same moment: their difference is
    what the new memory of a step's activations costs, and the kept runs are the kernels
    alone. A process of its own: glibc's thresholds, once a kept heap has held a step,
    do not give a steady heap back (a step then faulted 310-516 MiB afresh where it had
    faulted 1,013), and a fork cannot run the parent's OpenMP kernels (its first parallel
    kernel waits forever). None where it cannot start (a C library without a kept heap)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @classmethod
    def start(cls, shape: dict, scale: float) -> _KeptDecoder | None:
        if mapped_from() is None:  # this process keeps its heap: nothing to compare with
            return None
        what = json.dumps({"shape": shape, "scale": scale, "threads": torch.get_num_threads()})
        try:
            return cls(subprocess.Popen(
                [sys.executable, "-c",
                 "from engine.planning.reference_decoder import kept_decoder;"
                 f"kept_decoder({what!r})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1, cwd=Path(__file__).resolve().parents[2]))
        except OSError:
            return None

    def ready(self, deadline: float) -> _KeptDecoder | None:
        """This, once its decoders are built; None (and it is stopped) where it failed or
        is not ready by `deadline`."""
        try:
            if self._answer(deadline) == "ready":
                return self
        except (OSError, ValueError):  # a system whose pipes select cannot wait on
            pass
        self.close(kill=True)
        return None

    def run(self) -> list[float] | None:
        """The thread seconds of one run of each depth, in turn; None where the process
        has failed."""
        try:
            self.process.stdin.write("run\n")
            self.process.stdin.flush()
            seconds = [float(s) for s in (self._answer(time.perf_counter() + KEPT_WAIT)
                                          or "").split()]
        except (OSError, ValueError):
            return None
        return seconds if len(seconds) == 2 else None

    def _answer(self, deadline: float) -> str | None:
        ready, _, _ = select.select([self.process.stdout], [], [],
                                    max(0.0, min(deadline - time.perf_counter(), 3600.0)))
        return self.process.stdout.readline().strip() if ready else None

    def close(self, *, kill: bool = False) -> None:
        """Stop the process: at the end of its input, or at once (`kill`)."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=0 if kill else 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def kept_decoder(what: str) -> None:
    """`_KeptDecoder`'s process: the reference decoders built in a kept heap; each line
    "run" on stdin runs each depth once and answers their thread seconds."""
    from engine.devices.host_memory import kept_heap

    kept = kept_heap()
    asked = json.loads(what)
    torch.set_num_threads(asked["threads"])
    reference = _Reference(torch.device("cpu"), lambda: None, asked["scale"], "fp32",
                           asked["shape"])
    print("ready" if kept else "no kept heap", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        with torch.random.fork_rng(devices=[]):
            seconds = reference.run_each(time.thread_time)
        print(" ".join(f"{s:.6f}" for s in seconds), flush=True)


def _factor(run: float, fresh: float, kernels: float) -> float:
    """The reference decoder's `run` seconds, less its `fresh` seconds of new memory (priced
    apart: `_less_fresh`), over its `kernels`' forecast at the rates."""
    if kernels <= 0:
        return 1.0
    return _less_fresh(run, fresh) / kernels


def _less_fresh(run: float, fresh: float) -> float:
    """`run` seconds less `fresh` seconds of new memory, taken off at most down to half the
    run: its probe can meet the host's page handling at a slow moment (the same 800 MiB took
    0.35 s to 8 s here), and taken off whole it left a factor of 0, which makes every compute
    forecast nothing."""
    return max(run - fresh, run / 2)


def _kernels(cal: Calibration, work: StepWork, precision: str = "fp32") -> float:
    """Seconds of a plain forward and backward at the rates alone (no factor, no new
    memory)."""
    return cal.kernel_seconds(precision, work.hidden, work.forward_flops + work.backward_flops,
                              work.forward_bytes + work.backward_bytes,
                              work.forward_random + work.backward_random)


def _fresh(cal: Calibration, work: StepWork) -> float:
    return cal.activation_seconds(work.forward_fresh + work.backward_fresh)
