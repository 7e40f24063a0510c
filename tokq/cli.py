"""The `tokq` command line. Every command: --help, --json PATH, --threads, --device, --seed; `tokq --debug`.

The commands (tokq.commands.*) parse options, call the Python API (tokq.api) and print; this module wires them
into one typer app and turns exceptions into exit codes.

Exit codes (tokq.errors): 0 ok, 1 a check failed (a regression), 2 bad usage or input, 3 inconclusive (the
data could not decide: rerun or lengthen the run, never a pass), 4 internal error, 130 interrupted. Errors
the user can fix print one line, `error: <what and how to fix>`, with no traceback. Any other exception is
a bug in tokq: one line, `error: internal error (<type>: <message>); the traceback is in <log file>` (under
$TOKQ_HOME/logs/), exit 4; `tokq --debug ...` or TOKQ_DEBUG=1 prints the traceback too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from tokq import __version__
from tokq.commands.bench import bench_cmd
from tokq.commands.compare import compare_cmd
from tokq.commands.data import data_app
from tokq.commands.gate import gate_cmd
from tokq.commands.init import init_cmd
from tokq.commands.kernels import kernels_app
from tokq.commands.kv_calc import kv_calc_cmd
from tokq.commands.models import models_app
from tokq.commands.quantize import quantize_cmd
from tokq.commands.report import report_cmd
from tokq.commands.score import score_cmd
from tokq.commands.sensitivity import sensitivity_cmd
from tokq.commands.serve import serve_cmd
from tokq.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, TokqError, interrupt_on_signal
from tokq.paths import tokq_home

app = typer.Typer(
    name="tokq",
    help="Quantize LLMs, run them on tokq's engine, and gate releases on speed and long-document quality.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(models_app)
app.add_typer(data_app)
app.add_typer(kernels_app)
app.command("score")(score_cmd)
app.command("quantize")(quantize_cmd)
app.command("kv-calc")(kv_calc_cmd)
app.command("bench")(bench_cmd)
app.command("compare")(compare_cmd)
app.command("sensitivity")(sensitivity_cmd)
app.command("init")(init_cmd)
app.command("report")(report_cmd)
app.command("gate")(gate_cmd)
app.command("serve")(serve_cmd)


@dataclass
class _Session:
    debug: bool = False  # set by `tokq --debug` for one main() call (tests call main() many times)


_session = _Session()


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="On an internal error (exit 4) print the traceback too, not "
                                                      "only to the log file (also TOKQ_DEBUG=1)."),
) -> None:
    _session.debug = _session.debug or debug


@app.command("version")
def version_cmd() -> None:
    """Print tokq's version."""
    print(__version__)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_time=False, show_path=False)])
    outer_debug = _session.debug
    # A CI cancel or `docker stop` sends SIGTERM: unwind like Ctrl-C (exit 130), so every command's cleanup runs
    # (scratch folders, half-written outputs, the output lock) instead of the process dying mid-write.
    # `tokq serve` installs its own graceful handler while it serves.
    in_main_thread = threading.current_thread() is threading.main_thread()  # signals can only be set there
    previous_sigterm = signal.signal(signal.SIGTERM, interrupt_on_signal) if in_main_thread else None
    try:
        # Without standalone mode typer turns Ctrl-C into a returned exit code (130) instead of raising.
        code = app(args=argv, prog_name="tokq", standalone_mode=False)
        if isinstance(code, int) and code:
            if code == 130:
                Console(stderr=True).print("aborted")
            return code
    except TokqError as exc:
        # escape: messages name TOML tables like [base], which rich would read as markup and drop
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(exc.message)}", soft_wrap=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("aborted")
        return 130
    except Exception as exc:
        # Usage errors arrive as (typer's vendored) click exceptions: they know how to show themselves.
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()
            return EXIT_BAD_INPUT
        return _internal_error(exc, argv)
    finally:
        _session.debug = outer_debug
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm if previous_sigterm is not None else signal.SIG_DFL)
    return 0


def _internal_error(exc: Exception, argv: list[str] | None) -> int:
    """A bug, not bad input: one line naming the exception and the log file that holds its traceback; exit 4."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log_file = _write_crash_log(trace, sys.argv[1:] if argv is None else argv)
    if _session.debug or os.environ.get("TOKQ_DEBUG", "") not in ("", "0"):
        sys.stderr.write(trace)
    where = (f"the traceback is in {log_file}" if log_file else
             "the traceback could not be written under $TOKQ_HOME/logs/; rerun with --debug to print it")
    print(f"error: internal error ({type(exc).__name__}: {' '.join(str(exc).split())}); {where}", file=sys.stderr)
    return EXIT_INTERNAL


def _write_crash_log(trace: str, argv: list[str]) -> Path | None:
    """$TOKQ_HOME/logs/tokq-<time>-<pid>.log with the command, versions and traceback; None if it cannot be written."""
    folder = tokq_home() / "logs"
    stem = f"tokq-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(1, 100):  # two crashes in one second of one process keep both logs
            path = folder / (stem + (f"-{n}" if n > 1 else "") + ".log")
            try:
                with open(path, "x", encoding="utf-8") as f:
                    f.write(f"tokq {__version__}, python {sys.version.split()[0]}, {sys.platform}\n"
                            f"command: tokq {' '.join(argv)}\n\n{trace}")
                return path
            except FileExistsError:
                continue
    except OSError:
        pass
    return None


def run() -> None:
    sys.exit(main())
