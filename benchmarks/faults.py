"""Fault suite: the pipeline under steady load while its parts are killed, stalled or overrun.

Loopback only, bounded in time (FULL ≈ 3–4 min, plus ≈ 4 min for the two Rotel scenarios, which
wait the 60 s store timeout twice when Rotel lost spans; --short ≈ 1.5 min). Prints ONE JSON object: the
parameters, then per scenario spans (or requests) sent / acknowledged / stored / lost / duplicated,
client-side drops (decided by the real OTel SDK exporter's retry budget and queue), time to recover
and the scenario's own figures. `no_fault` is the same-run baseline. Scenarios:
phaselens.faults.collector_faults and phaselens.faults.serving_faults (their docstrings define each
recover_s).

    python benchmarks/faults.py [--short] [--outage-s 30] [--only collector_sigkill,spool_full] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from phaselens.faults import suite
from phaselens.faults.outcome import markdown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the CI form: short outages and loads")
    parser.add_argument(
        "--outage-s",
        type=float,
        default=None,
        help=f"seconds ClickHouse stays down ({suite.FULL.outage_s:g}; short: {suite.SHORT.outage_s:g})",
    )
    parser.add_argument("--only", default=",".join(suite.SCENARIOS), help="comma-separated scenario names")
    parser.add_argument("--work-dir", default=None, help="where ClickHouse, spools and logs go (a temporary folder)")
    parser.add_argument("--markdown", action="store_true", help="also print the table of docs/faults.md on stderr")
    args = parser.parse_args()
    params = suite.SHORT if args.short else suite.FULL
    if args.outage_s is not None:
        params = dataclasses.replace(params, outage_s=args.outage_s)

    def progress(o):
        return print(
            f"{o.scenario}: lost {o.lost}, duplicated {o.duplicated}, recover {o.recover_s} s",
            file=sys.stderr,
            flush=True,
        )

    outcomes = suite.run(params, tuple(filter(None, args.only.split(","))), args.work_dir, progress)
    print(json.dumps({"params": dataclasses.asdict(params), "scenarios": [o.as_dict() for o in outcomes]}))
    if args.markdown:
        print(markdown(outcomes), file=sys.stderr)
    return 0 if all(o.lost == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
