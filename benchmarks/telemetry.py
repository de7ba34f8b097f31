"""What watching a run costs: how late step samples reach the UI, and whether reading them
slows training.

One real worker (tuitrain.worker.ProcessWorker) per model trains while the consumer on this
side changes every few steps, in rounds, so that a machine whose load drifts affects every
consumer alike:

- unread: nobody reads the event pipe (events wait in the worker); the end of the phase is
  seen in the metrics file, then everything is drained.
- ui-10hz: a UI-like consumer that polls every 100 ms and formats what it got, as the TUI's
  timer does.
- waiting: a consumer that blocks on the pipe (ProcessWorker.wait), as the headless runner
  does; its latency is the cost of the channel itself.

Latency is from the end of a step in the worker (the stamp on its Step event) to `poll()`
returning that event; the target is a median under 50 ms for the channel. The step rate is
measured in the worker from those stamps, over the steps that ran wholly inside a phase.

    python benchmarks/telemetry.py                       # tiny and opt-125m
    python benchmarks/telemetry.py --models tiny --steps 50 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tuitrain.events import Failed, Finished, Started, Step
from tuitrain.settings import Settings
from tuitrain.worker import ProcessWorker

CONSUMERS = ("unread", "ui-10hz", "waiting")
UI_INTERVAL = 0.1  # the TUI drains the channel on a 10 Hz timer
UNREAD_CHECK = 0.2  # how often the unread phase looks at the metrics file
# Steps per phase: a phase must hold a few steps to time them; opt-125m is ~1 s a step.
DEFAULT_STEPS = {"tiny": 30, "opt-125m": 3}
START_SECONDS = 600.0


@dataclass
class Consumer:
    rates: list[float] = field(default_factory=list)  # steps per second, one per phase
    latencies: list[float] = field(default_factory=list)  # seconds, one per Step event

    def latency_ms(self, quantile: float) -> float:
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class Run:
    """A worker, the stamps of its steps, and the consumer currently reading it."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.worker = ProcessWorker(settings=settings, log_path=folder / "worker.log")
        self.metrics = Path(settings.logging.metrics or "")
        self.ended: dict[int, float] = {}  # step -> when it ended in the worker
        self.last_step = 0
        self.finished = False
        self._metrics_lines = 0
        self._metrics_offset = 0

    def take(self, latencies: list[float] | None) -> None:
        """Drain the events; record latencies into `latencies` unless it is None."""
        received = time.time()
        screen = []  # what a UI would draw from the samples
        for event in self.worker.poll():
            if isinstance(event, Step):
                self.ended[event.stats.step] = event.time
                self.last_step = max(self.last_step, event.stats.step)
                if latencies is not None:
                    latencies.append(received - event.time)
                screen[:] = [f"{event.stats.loss:.4f} {event.stats.memory.device_peak}"]
            elif isinstance(event, Failed):
                raise SystemExit(f"the worker failed: {event.reason}")
            elif isinstance(event, Finished):
                self.finished = True
            elif isinstance(event, Started):
                print(f"  {event.model}: {event.parameters:,} parameters on {event.device}")

    def steps_written(self) -> int:
        """Steps in the metrics file so far (its first line is the settings)."""
        with open(self.metrics, "rb") as file:
            file.seek(self._metrics_offset)
            data = file.read()
        self._metrics_offset += len(data)
        self._metrics_lines += data.count(b"\n")
        return max(0, self._metrics_lines - 1)

    def phase(self, consumer: str, steps: int, into: Consumer) -> None:
        begun = time.time()
        target = self.last_step + steps
        deadline = time.monotonic() + START_SECONDS
        if consumer == "unread":
            while self.steps_written() < target:
                time.sleep(UNREAD_CHECK)
                _check(deadline)
            self.take(None)
        while self.last_step < target:
            _check(deadline)
            if consumer == "ui-10hz":
                time.sleep(UI_INTERVAL)
                self.take(into.latencies)
            else:
                self.worker.wait(1.0)
                self.take(into.latencies if consumer == "waiting" else None)
        # Between the first and the last step end inside the phase, every step ran wholly
        # under this consumer.
        inside = sorted(t for s, t in self.ended.items() if t > begun and s <= target)
        if len(inside) > 1:
            into.rates.append((len(inside) - 1) / (inside[-1] - inside[0]))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _check(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise SystemExit("the worker made no progress in time")


def measure(model: str, steps: int, rounds: int, precision: str) -> dict[str, Consumer]:
    consumers = {name: Consumer() for name in CONSUMERS}
    with tempfile.TemporaryDirectory(prefix="tuitrain-telemetry-") as tmp:
        settings = Settings(
            model=model,
            engine={"precision": precision},
            # one more step: the first traces the model and is timed apart
            training={"steps": 1 + rounds * len(CONSUMERS) * steps},
            logging={"metrics": str(Path(tmp) / "metrics.jsonl")},
        )
        run = Run(settings, Path(tmp))
        run.worker.start()
        try:
            deadline = time.monotonic() + START_SECONDS
            while run.last_step < 1:
                _check(deadline)
                run.worker.wait(1.0)
                run.take(None)
            for _ in range(rounds):
                for name in CONSUMERS:
                    run.phase(name, steps, consumers[name])
            while not run.finished:
                _check(deadline + START_SECONDS)
                run.worker.wait(1.0)
                run.take(None)
        finally:
            run.worker.stop()
    return consumers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_STEPS))
    parser.add_argument("--steps", type=int, help="steps per phase (default: per model)")
    parser.add_argument("--rounds", type=int, default=3, help="times each consumer reads")
    # fp32 is the fastest on a CPU: the most samples per second for the channel to carry.
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = parser.parse_args()

    for model in args.models:
        steps = args.steps or DEFAULT_STEPS.get(model, 5)
        print(f"\n{model}: {args.rounds} rounds of {steps} steps per consumer, {args.precision}")
        consumers = measure(model, steps, args.rounds, args.precision)
        unread = _median(consumers["unread"].rates)
        # The spread of the per-phase rates says how much of a difference is the machine.
        print(
            f"  {'consumer':<9} {'steps/s':>8} {'phases':>13} {'vs unread':>10} "
            f"{'latency median':>15} {'p95':>9}"
        )
        for name, seen in consumers.items():
            rate = _median(seen.rates)
            spread = f"{min(seen.rates):.2f}-{max(seen.rates):.2f}" if seen.rates else "-"
            latency = "          -         -"
            if seen.latencies:
                latency = f"{seen.latency_ms(0.5):12.1f} ms {seen.latency_ms(0.95):6.1f} ms"
            print(f"  {name:<9} {rate:8.2f} {spread:>13} {rate / unread:9.3f}x {latency}")
        channel = consumers["waiting"].latency_ms(0.5)
        verdict = "meets" if channel < 50 else "misses"
        print(
            f"  channel latency {channel:.1f} ms median: {verdict} the 50 ms target; a 10 Hz "
            f"UI adds up to {1000 * UI_INTERVAL:.0f} ms of timer wait"
        )


if __name__ == "__main__":
    main()
