"""`phaselens sql write|check`: the checked-in SQL files of the analysis queries (`analysis/sql/`)."""

from __future__ import annotations

from pathlib import Path

from phaselens.analysis.sql import sql_files
from phaselens.commands._generated import report_stale, report_written


def register(subparsers) -> None:
    parser = subparsers.add_parser("sql", help="render every analysis query to analysis/sql/<name>.sql, or check them")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, func, text in (
        ("write", run_write, "write sql/*.sql from phaselens.analysis.queries"),
        ("check", run_check, "exit 1 if a checked-in file differs from a fresh rendering"),
    ):
        p = actions.add_parser(action, help=text)
        p.add_argument(
            "--out",
            type=Path,
            default=sql_files.PACKAGE_DIR,
            help="folder that holds sql/ (default: the analysis package's own)",
        )
        p.set_defaults(func=func)


def run_write(args) -> int:
    return report_written(sql_files.write(args.out))


def run_check(args) -> int:
    return report_stale(sql_files.stale_files(args.out), "phaselens sql write")
