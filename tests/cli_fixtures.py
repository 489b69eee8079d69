"""Running phaselens commands from tests: one command module's `run` in this process, as `phaselens`
would call it (without importing every other command module), or `phaselens bench` as a child."""

from __future__ import annotations

import argparse
import sys


def run_command(register, *argv: str) -> int:
    """Parse `argv` with the parser `register` adds and run the command; its exit code."""
    parser = argparse.ArgumentParser(prog="phaselens")
    register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.func(args)


def bench_argv(url: str, *args: str) -> list[str]:
    """`python -m phaselens bench --url URL --model tiny ARGS`: the argv of a bench child against a
    server of the built-in tiny model (or vLLM serving it under that name)."""
    return [sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny", *args]
