"""The `tokq` command line. Every command: --help, --json PATH, --threads, --device, --seed.

Exit codes: 0 ok, 1 a check failed (a regression), 2 bad usage or input. Errors the user can fix
print one line, `error: <what and how to fix>`, with no traceback.
"""

from __future__ import annotations

import logging
import sys

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
from tokq.errors import EXIT_BAD_INPUT, TokqError

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
app.command("init")(init_cmd)
app.command("report")(report_cmd)
app.command("gate")(gate_cmd)


@app.command("version")
def version_cmd() -> None:
    """Print tokq's version."""
    print(__version__)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_time=False, show_path=False)])
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
        raise
    return 0


def run() -> None:
    sys.exit(main())
