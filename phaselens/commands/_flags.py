"""Flags that would not take effect are refused by name: a flag a subcommand accepts changes the run,
or the command stops with a usage error (exit 2) saying why. Each parser sets `_parser` to itself
(`set_defaults(_parser=parser)`). Shared by the commands, not one itself."""

from __future__ import annotations

import argparse


def given(args: argparse.Namespace, *dests: str) -> list[str]:
    """`--flag-name` of each of `dests` whose value differs from its parser's default (a flag given
    with its default value changes nothing, so it passes)."""
    parser: argparse.ArgumentParser = args._parser
    return [f"--{dest.replace('_', '-')}" for dest in dests if getattr(args, dest) != parser.get_default(dest)]


def refuse(args: argparse.Namespace, flags: list[str], reason: str) -> None:
    """A usage error naming `flags` and why they do not apply (SystemExit 2); nothing when `flags` is empty."""
    if flags:
        args._parser.error(f"{', '.join(flags)} {reason}")
