"""Fresh processes for the tests, forked from a server that imported torch and transformers
once per test process.

A spawned process spends seconds of the machine's CPU importing them, every time; a forked
one starts at once, a copy of the server as it was before its first fork, so nothing one
process changes reaches the next. What differs from a spawned process is only what the
server holds: its imports' memory is already resident when the child starts. So a fork
serves tests that compare a process with itself or with another forked one (a growth, a
difference, a peak past a reset of the high-water mark), not a fresh interpreter's
absolute peak.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import tempfile
from multiprocessing.context import ForkServerContext
from pathlib import Path

# What the server imports before it forks: the slow imports every such process makes. Not
# the repository's own packages: the server's sys.path is not the test run's (each child
# gets that from multiprocessing), and it could find another checkout's engine.
PRELOAD = ["torch", "torch.distributed", "transformers.models.opt.modeling_opt",
           "transformers.models.llama.modeling_llama"]


def context() -> ForkServerContext:
    """multiprocessing's fork server, started with PRELOAD at its first fork."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # once the server runs, this changes nothing
    return ctx


def adopt(environ: dict[str, str]) -> None:
    """In a forked child: the test's environment, as a spawned child would inherit it (a
    forked one has the server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None  # chosen again from TMPDIR
    # The server's imports, out of the cycle collector's sight (tests/conftest.py says
    # why): each engine's close collects, and would walk all of them every time.
    gc.freeze()


def _exec(script: str, argv: list[str], out: str, environ: dict[str, str]) -> None:
    adopt(environ)
    with open(out, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.argv = ["-c", *argv]
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()


class Running:
    """A script started in a forked process (`start_script`); `output` waits for it."""

    def __init__(self, script: str, argv: list[str], tmp: tempfile.TemporaryDirectory) -> None:
        self._tmp = tmp
        self._out = Path(tmp.name) / "out"
        self._child = context().Process(target=_exec, args=(script, argv, str(self._out),
                                                            dict(os.environ)))
        self._child.start()

    def output(self, timeout: float) -> str:
        """Its output (stdout and stderr together) once it has ended. Fails with that output
        if it fails or is still running `timeout` seconds from now."""
        child = self._child
        try:
            child.join(timeout)
            if child.is_alive():
                child.kill()
                child.join()
                raise AssertionError(
                    f"still running after {timeout:g} s:\n{self._out.read_text()}")
            text = self._out.read_text() if self._out.exists() else ""
        finally:
            self._tmp.cleanup()
        if child.exitcode != 0:
            raise AssertionError(f"exit code {child.exitcode}:\n{text[-3000:]}")
        return text


    def kill(self) -> None:
        """End it if it still runs (a test that failed before asking for its output)."""
        if self._child.is_alive():
            self._child.kill()
        self._child.join()
        self._tmp.cleanup()


def start_script(script: str, *argv: str) -> Running:
    """Start `script` as `python -c script *argv` would, in a forked process, and return
    at once: several such processes run side by side, each with its own resident memory
    and high-water mark, so measuring them together changes neither."""
    return Running(script, list(argv), tempfile.TemporaryDirectory())


def run_script(script: str, *argv: str, timeout: float) -> str:
    """Run `script` as `python -c script *argv` would, in a forked process; its output
    (stdout and stderr together). Fails with that output if it fails or outlives
    `timeout` seconds."""
    return start_script(script, *argv).output(timeout)
