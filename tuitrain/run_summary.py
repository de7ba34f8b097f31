"""A run's summary in words: how it ended, its loss and held-out loss, its peaks, and what
each setting it ran under achieved (tuitrain.trials), from the worker's Finished summary.

The app ends a run with these lines; they use the trials' words for a pace ("median of N
settled steps"), so no second definition of a rate appears beside it. A run that writes
metrics ends them with its summary (`record_summary`), whichever UI started it.
"""

from __future__ import annotations

from tuitrain.formatting import format_seconds, format_size
from tuitrain.trials import Trial, append_summary, summary_lines


def ended_line(summary: dict) -> str:
    """ "finished: 200 steps, 102,400 tokens in 1m54s" or "stopped after step 4 of 200: ..."."""
    steps, planned = summary.get("steps", 0), summary.get("planned_steps")
    head = (
        f"stopped after step {summary.get('last_step', steps)} of {planned}"
        if summary.get("stopped") and planned
        else "finished"
    )
    done = f"{steps} step{'' if steps == 1 else 's'}, {summary.get('tokens', 0):,} tokens"
    if summary.get("seconds") is not None:
        done += f" in {format_seconds(summary['seconds'])}"
    return f"{head}: {done}"


def run_summary_lines(summary: dict, rows: list[Trial]) -> list[str]:
    """The run's summary, one fact a line (the trials' lines last)."""
    lines = [ended_line(summary)]
    losses = []
    if summary.get("final_loss") is not None:
        losses.append(f"final loss {summary['final_loss']:.4f}")
    if summary.get("first_step_seconds") is not None:
        losses.append(f"first step {format_seconds(summary['first_step_seconds'])}")
    if losses:
        lines.append("  " + ", ".join(losses))
    if summary.get("eval_loss") is not None:
        lines.append("  " + held_out(summary))
    if peaks := peaks_line(summary):
        lines.append("  " + peaks)
    lines += summary_lines(rows)
    if summary.get("metrics"):
        lines.append(f"  metrics  {summary['metrics']}")
    return lines


def record_summary(summary: dict, rows: list[Trial]) -> str | None:
    """Append the run's summary and its trials to its metrics file, the file's last line,
    when the run writes one: the headless runner and the app end a run alike, so
    `tuitrain attach FILE` shows it as it ended. Returns the line to show when the file
    cannot be written (the run itself went well), else None."""
    if not summary.get("metrics"):
        return None
    try:
        append_summary(summary["metrics"], summary, rows)
    except ValueError as error:
        return f"summary not added to the metrics: {error}"
    return None


def held_out(summary: dict) -> str:
    """The latest evaluation: "held-out loss 3.7140, perplexity 41.01 after step 200"."""
    return (
        f"held-out loss {summary['eval_loss']:.4f}, perplexity "
        f"{summary['eval_perplexity']:.2f} after step {summary['eval_step']}"
    )


def peaks_line(summary: dict) -> str:
    """ "peak device 2.0 GiB, peak host RSS 3.0 GiB": the highest of the run's steps, as
    the trials and a saved preset give them (the host's is each step's VmHWM); "" before a
    step ran."""
    peaks = []
    if summary.get("peak_device_bytes"):
        peaks.append(f"peak device {format_size(summary['peak_device_bytes'])}")
    if summary.get("peak_host_bytes"):
        peaks.append(f"peak host RSS {format_size(summary['peak_host_bytes'])}")
    return ", ".join(peaks)
