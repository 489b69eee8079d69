"""One command module's `run`, in this process, as `phaselens` would call it (without importing
every other command module)."""

from __future__ import annotations

import argparse


def run_command(register, *argv: str) -> int:
    """Parse `argv` with the parser `register` adds and run the command; its exit code."""
    parser = argparse.ArgumentParser(prog="phaselens")
    register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.func(args)
