"""The JSONL metrics of a run: written by the worker, read back for a preset's header and
for a finished run's replay. A pace is not measured here: it is the trials' (medians of
settled steps, tuitrain.trials), the one definition every screen uses.

A metrics file holds, per run, one line of settings (`{"settings": ..., ...}`) and then one
`dataclasses.asdict(StepStats)` per step (a top-level "step" key), with, in a run that
evaluates, a line `{"eval": dataclasses.asdict(Eval)}` after each evaluation. Files are
appended to, so one file can hold several runs; readers take the latest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO


class MetricsWriter:
    """Appends records to a metrics file, one JSON line each, flushed as written."""

    def __init__(self, path: str | os.PathLike) -> None:
        """Open `path` for appending (its folder is made); ValueError when that fails."""
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # Appended, never truncated: a metrics file the user already had is kept whole.
            self._file: TextIO | None = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot write metrics to {path}: {err.strerror or err}") from err

    def write(self, record: dict) -> None:
        assert self._file is not None, "the metrics file is closed"
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError:  # the write that failed is already reported; closing retries it
            pass
        self._file = None


def latest_run(path: str | os.PathLike) -> list[dict]:
    """The step records of the latest run in a metrics file; empty when it cannot be read.

    Lines that are not JSON (a run killed mid-write) are skipped.
    """
    return _latest_records(path)[0]


def latest_evals(path: str | os.PathLike) -> list[dict]:
    """The evaluations of the latest run in a metrics file (each `dataclasses.asdict(Eval)`:
    step, loss, perplexity, tokens, seconds); empty when there are none."""
    return _latest_records(path)[1]


def _latest_records(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return [], []
    steps: list[dict] = []
    evals: list[dict] = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if "settings" in record:  # a new run starts here
            steps, evals = [], []
        elif "step" in record:
            steps.append(record)
        elif isinstance(record.get("eval"), dict):
            evals.append(record["eval"])
    return steps, evals
