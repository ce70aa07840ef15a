"""`python -m verispec.cli`: the `verispec` command."""

from verispec.cli import run

run()
