"""Entry point of the `phaselens` command: finds the subcommand modules and dispatches."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from phaselens import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phaselens",
        description="Latency budgets for LLM inference: client and server spans per phase, in ClickHouse.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):  # a private module is shared by commands, not one itself
            importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
