"""Errors that reach the user as one clear line and an exit code.

Exit codes are shared by every command: 0 ok, 1 a check failed (a regression), 2 bad usage or input,
3 inconclusive (the data could not decide, e.g. a noisy runner: rerun or lengthen the run, never a pass),
4 internal error (a bug in tokq: the CLI writes the traceback to a log file under $TOKQ_HOME/logs/),
130 interrupted. Library code raises these; the CLI prints `error: <message>` and exits with `exit_code`.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130


class TokqError(Exception):
    """A problem the user can fix: the message names the thing and the fix."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelError(TokqError):
    """A model or checkpoint that cannot be loaded (missing, corrupt, unsupported)."""


class DataError(TokqError):
    """A document folder or file that cannot be used."""


class ZooError(TokqError):
    """A zoo model that cannot be pulled."""


class ConfigError(TokqError):
    """A bad tokq.toml or command-line value."""


def interrupt_on_signal(signum, frame) -> None:
    """A signal handler (for SIGTERM) that unwinds like Ctrl-C: cleanup runs and the CLI exits 130."""
    raise KeyboardInterrupt(f"signal {signum}")
