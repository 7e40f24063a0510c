"""`python -m tokq ...`: the same CLI as the `tokq` script."""

from tokq.cli import run

run()
