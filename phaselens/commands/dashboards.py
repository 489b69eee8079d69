"""`phaselens dashboards generate|check|push`: the Grafana dashboards and their data source."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from phaselens.commands._flags import given, refuse
from phaselens.commands._generated import report_stale, report_written
from phaselens.dashboards import generate, push
from phaselens.dashboards.datasource import DEFAULT_PORTS, ClickHouseTarget, datasource


def register(subparsers) -> None:
    parser = subparsers.add_parser("dashboards", help="generate the Grafana dashboards or push them to a Grafana")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    gen = actions.add_parser("generate", help="write the dashboard JSON and provisioning YAML")
    gen.add_argument(
        "--out",
        type=Path,
        default=generate.PACKAGE_DIR,
        help="folder that gets generated/*.json and provisioning/ (default: the package's own)",
    )
    gen.set_defaults(func=run_generate)

    check = actions.add_parser("check", help="exit 1 if the checked-in files differ from a fresh generation")
    check.add_argument("--out", type=Path, default=generate.PACKAGE_DIR)
    check.set_defaults(func=run_check)

    p = actions.add_parser("push", help="create or update the data source and dashboards (idempotent)")
    p.add_argument("--grafana", required=True, metavar="URL", help="e.g. http://127.0.0.1:3000")
    p.add_argument(
        "--token", default=os.environ.get("GRAFANA_TOKEN"), help="service-account token (default: $GRAFANA_TOKEN)"
    )
    p.add_argument("--user", default=None, help="basic-auth user (with --password)")
    p.add_argument("--password", default=None)
    p.add_argument(
        "--clickhouse-host",
        default="clickhouse",
        help="ClickHouse host as Grafana's server reaches it (default: clickhouse)",
    )
    p.add_argument(
        "--clickhouse-port",
        type=int,
        default=None,
        help=f"default: {DEFAULT_PORTS['native']} native, {DEFAULT_PORTS['http']} http",
    )
    p.add_argument("--clickhouse-protocol", choices=sorted(DEFAULT_PORTS), default="native")
    p.add_argument("--database", default="otel", help="the database the panels and the data source read")
    p.add_argument("--folder", default="phaselens", help="folder uid and title (default: phaselens)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per API call")
    p.set_defaults(func=run_push, _parser=p)


def run_generate(args) -> int:
    return report_written(generate.write(args.out))


def run_check(args) -> int:
    return report_stale(generate.stale_files(args.out), "phaselens dashboards generate")


def run_push(args) -> int:
    if args.token is not None:
        refuse(args, given(args, "user", "password"), "would be ignored: a --token (or $GRAFANA_TOKEN) wins; give one")
    target = ClickHouseTarget(
        host=args.clickhouse_host, port=args.clickhouse_port, protocol=args.clickhouse_protocol, database=args.database
    )
    try:
        api = push.connect(
            args.grafana, token=args.token, user=args.user, password=args.password, timeout_s=args.timeout
        )
        result = push.push(api, datasource(target), generate.dashboards(args.database), args.folder, args.folder)
    except push.PushError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"pushed to {args.grafana}: {result.summary()}")
    return 0
