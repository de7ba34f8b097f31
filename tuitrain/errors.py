"""How a tuitrain process ends: its exit statuses, and the error that means "the user asked
for something that cannot be done".

The CLI, the headless runner, the app and the worker process all speak these numbers, so a
UI can tell a mistake in the input from a crash whichever process found it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # training failed: the reason and the worker's log are reported
EXIT_BAD_INPUT = 2  # the status argparse uses for a bad command line; ours match it
EXIT_ORPHANED = 3  # a worker whose parent died: nobody is left to report to
# 128 + SIGHUP: the app's terminal went away (closed, `tmux kill-session`, a dropped ssh),
# and the run it started was stopped at once.
EXIT_HUNG_UP = 129
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a job stopped by Ctrl-C
# 128 + SIGPIPE, what a shell reports for a tool that SIGPIPE ended: its reader went away
# (`| head`); a run it stopped ended as Ctrl-C ends one.
EXIT_CLOSED_PIPE = 141
# 128 + SIGTERM: a run told to end (`kill`, a batch system's time limit), stopped at once.
EXIT_TERMINATED = 143


class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""
