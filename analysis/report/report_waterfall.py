"""Spans → waterfall lanes, and the waterfall of a disaggregated request across instances
(docs/disaggregation.md#spans-across-hops): the client, the router, the prefill instance with its KV
transfer and the decode instance, each process's spans placed on that process's own clock; every hop
between hosts is a residual of durations, never a difference of two hosts' timestamps.

Placement (the report's rule, report_page.WATERFALL_NOTE, applied at each hop): the router's root is
centred in the client span; an instance's root starts half its hop after the router's span that called
it (`pd.prefill_call`, `pd.decode_call`): the hop split evenly before and after the instance's part; the
rest of a process at its offset from that process's root, on that process's clock:

    start(instance root) = start(caller) + hop / 2
    start(span)          = start(its process's root) + (span.start − root.start)   (one clock)
    hop                  = the P/D budget's prefill_hop_ms / decode_hop_ms (analysis.schema.pd_schema: the
                           caller's duration − the callee's to where its answer was handed on), else
                           caller.duration − root.duration (a root span outlasts its answer: this
                           one can come out negative)
"""

from __future__ import annotations

from collections.abc import Callable

from phaselens.analysis.report import report_charts as charts
from phaselens.analysis.report.report_data import TraceSpan
from phaselens.analysis.schema.pd_schema import INSTANCE_ROLES, ROLES
from phaselens.instrumentation import names

HOP_COLOR = "#c8ccd4"
KV_COLOR = "#d9a441"
ROLE_COLORS = {"router": "#8893a5", "prefill": "#5bb07a", "decode": "#4f7fc0"}
KV_SPANS = (names.SPAN_KV_TRANSFER, names.SPAN_KV_RECEIVE)


def tree_order(spans: list[TraceSpan], root: TraceSpan) -> list[tuple[TraceSpan, int]]:
    """Depth-first (span, depth) below `root` among `spans`, siblings by start (spans arrive in no order)."""
    children: dict[str, list[TraceSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_span_id, []).append(s)
    out: list[tuple[TraceSpan, int]] = []
    stack, seen = [(root, 0)], set()
    while stack:
        span, depth = stack.pop()
        if span.span_id in seen:  # malformed parent links must not loop
            continue
        seen.add(span.span_id)
        out.append((span, depth))
        kids = sorted(children.get(span.span_id, []), key=lambda s: s.start_ts, reverse=True)
        stack.extend((k, depth + 1) for k in kids)
    return out


def is_disaggregated(spans: list[TraceSpan]) -> bool:
    return any(s.role in INSTANCE_ROLES for s in spans)


def _processes(spans: list[TraceSpan]) -> list[list[TraceSpan]]:
    """The P/D processes' spans (one service and instance each: one clock), router first, then prefill,
    then decode."""
    by_process: dict[tuple[str, str], list[TraceSpan]] = {}
    for s in spans:
        if s.role in ROLES:
            by_process.setdefault((s.service, s.instance), []).append(s)
    return sorted(by_process.values(), key=lambda p: (ROLES.index(p[0].role), min(s.start_ts for s in p)))


def _root(process: list[TraceSpan]) -> TraceSpan:
    """The process's SERVER span (its request), else its earliest span."""
    servers = [s for s in process if s.kind.lower().endswith("server")]
    return min(servers or process, key=lambda s: s.start_ts)


def _process_lanes(
    process: list[TraceSpan], anchor_ms: float, depth: int, color: Callable[[str], str]
) -> list[tuple[TraceSpan, charts.Lane]]:
    """The lanes of one process: its root's subtree, then its spans whose parent is in another
    process (the decode side's `llm.kv_receive` under the prefill's `llm.kv_transfer`), all at their
    offsets from the root on this process's clock."""
    root = _root(process)
    ids = {s.span_id for s in process}
    tops = [
        root,
        *sorted((s for s in process if s is not root and s.parent_span_id not in ids), key=lambda s: s.start_ts),
    ]
    out: list[tuple[TraceSpan, charts.Lane]] = []
    for top in tops:
        for s, d in tree_order(process, top):
            start = anchor_ms + (s.start_ts - root.start_ts) / 1e6
            if s is root:
                label, fill = f"{s.role} · {s.instance or s.service} ({s.role} clock)", ROLE_COLORS[s.role]
            else:
                label, fill = s.name, KV_COLOR if s.name in KV_SPANS else color(s.name)
            out.append(
                (s, charts.Lane(label, start, s.duration_ns / 1e6, fill, depth + d + (top is not root), s.service))
            )
    return out


def layout_disaggregated(
    spans: list[TraceSpan], color: Callable[[str], str], client_color: str, hops_ms: dict[str, float]
) -> tuple[list[charts.Lane], float]:
    """Lanes for one disaggregated trace: the client span at 0, then the router, a hop and the prefill
    instance, a hop and the decode instance (placement: the module's docstring; `hops_ms`: role → the
    P/D budget's hop)."""
    client = next((s for s in spans if not s.role and s.kind.lower().endswith("client")), None)
    lanes: list[charts.Lane] = []
    if client:
        lanes.append(
            charts.Lane(f"client · {client.name}", 0.0, client.duration_ns / 1e6, client_color, 0, client.service)
        )
    placed: dict[str, charts.Lane] = {}
    for process in _processes(spans):
        root = _root(process)
        caller = placed.get(root.parent_span_id)
        if caller is not None:
            hop_ms = hops_ms.get(root.role, caller.duration_ms - root.duration_ns / 1e6)
            anchor, depth = caller.start_ms + hop_ms / 2, caller.depth + 1
            note = f"hop = {caller.label} − {root.role}'s part: a residual of two durations"
            lanes.append(charts.Lane(f"hop → {root.role} (residual)", caller.start_ms, hop_ms, HOP_COLOR, depth, note))
        elif client and root.role == "router":
            anchor, depth = (client.duration_ns - root.duration_ns) / 2e6, 1
        else:  # no caller among the stored spans: this process starts the axis
            anchor, depth = 0.0, 0
        for s, lane in _process_lanes(process, anchor, depth, color):
            placed[s.span_id] = lane
            lanes.append(lane)
    total = max([client.duration_ns / 1e6 if client else 0.0] + [ln.start_ms + ln.duration_ms for ln in lanes])
    return lanes, total
