"""The `phaselens` command: every subcommand registers, and building the parser stays light."""

import subprocess
import sys

EXPECTED = {
    "bench",
    "budget",
    "clickhouse",
    "collector",
    "dashboards",
    "demo",
    "diagnose",
    "import",
    "report",
    "rollup",
    "schema",
    "serve",
    "sql",
}


def test_every_subcommand_registers_without_importing_torch():
    # Only `serve` (and the demo's server child) needs torch; `phaselens budget` must not pay for it.
    code = (
        "import sys, argparse\n"
        "from phaselens.cli import build_parser\n"
        "p = build_parser()\n"
        "sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))\n"
        "print(','.join(sorted(sub.choices)))\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    names, heavy = out.splitlines()
    assert set(names.split(",")) == EXPECTED
    assert heavy == "False False"


def test_unknown_subcommand_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "phaselens", "frobnicate"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
