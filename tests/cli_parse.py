"""Parse `tokq ARGS` with the CLI's own parser (commands, options and their types) without running it: the check
that a command shown in the docs or run by a CI example is one the CLI accepts."""

from __future__ import annotations


def parse_cli(argv: list[str]):
    """The leaf command's click context for `tokq *argv`; raises on an unknown command or option, or a value of
    the wrong type."""
    from typer.main import get_command

    from tokq.cli import app

    cmd, args, parent, name = get_command(app), argv, None, "tokq"
    while True:
        ctx = cmd.make_context(name, list(args), parent=parent)
        if not hasattr(cmd, "resolve_command"):  # a leaf command: parsed and type-checked
            return ctx
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, cmd, args = cmd.resolve_command(ctx, rest)
        parent = ctx
