"""The exit codes `mj` promises to scripts, and the error for a bad command line."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    # The job did not succeed, or a service answered with an error.
    FAILED = 1
    # A bad command line or an unreadable input file.
    USAGE = 2
    # A service could not be reached.
    UNREACHABLE = 3
    # Ctrl-C.
    INTERRUPTED = 130
    # The reader of our output went away (`mj logs 3 | head`), as a shell reports SIGPIPE.
    BROKEN_PIPE = 141


class UsageError(Exception):
    """A mistake on the command line that argparse cannot see, e.g. a missing job file."""
