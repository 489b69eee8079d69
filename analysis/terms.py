"""Every budget term, declared once: what it is, where it comes from, how it is shown. The budget
queries, the rollups, the report, the dashboards, `phaselens budget` and the term table of
docs/budget-method.md read these declarations (docs/budget-method.md#the-terms).

Two budgets read them, each term a duration on one clock (docs/budget-method.md, docs/disaggregation.md):

    aggregated:  TTFT_client = Σ `Registry.components`   (inbound … residual, in TTFT order)
    P/D:         TTFT_client = Σ `Registry.pd_terms`     (the edges, residual, then the hops and instances)

A term's `rollup_position` (aggregated) and `pd_position` (P/D) are its slots in the rollups' sketch and
mean arrays: sealed rollup rows keep them, so they are append-only. A new term takes the next free one.
A P/D term counted 0 where a request did not stamp it (`sql` ≠ `column`) also declares
`pd_witness_position`: the slot of its column over the complete requests, whose NULL mean says no
request of a read stamped it (the term is then unobserved, never 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from phaselens.instrumentation import names as n


@dataclass(frozen=True, slots=True)
class Term:
    """One budget term. `sql` is its value in a budget row over the per-request facts (an edge nobody
    stamped counts 0 there, so the mean row adds up); `column` holds it per request, NULL where unstamped."""

    name: str  # column, JSON and CSV name; the suffix is the unit
    label: str  # the report's legend
    colour: str  # the report's and the dashboards' segment colour
    clock: str  # which side stamps it: server, client, router, prefill, decode; or difference (a residual)
    source: str  # the span attribute or span it comes from (markdown)
    sql: str
    column: str
    starts: str = "—"  # docs: the stamp it starts at (markdown)
    ends: str = "—"
    clock_note: str = ""  # docs: how the clock is read, where it is not plain
    unit: str = "ms"
    estimate: bool = False  # an estimate, not a difference of stamps: labelled wherever shown
    in_ttft: bool = True  # a term of the TTFT sum; False: a part of one, shown beside it
    aggregated: bool = True  # in the aggregated budget (False: the P/D budget's own)
    rollup_position: int | None = None  # 1-based slot in the aggregated rollup arrays (append-only)
    pd_position: int | None = None  # 1-based slot in the P/D budget and its rollup arrays (append-only)
    pd_witness_position: int | None = None  # 1-based slot of its P/D witness in those arrays (append-only)
    observed_by: str | None = None  # the distribution whose NULL mean says no request stamped it
    part_of: str | None = None  # the term this part belongs to
    beside: bool = False  # a part shown beside its term, outside its sum

    @property
    def stem(self) -> str:
        """The name without its unit suffix (`queue` of `queue_ms`): the dominant-phase label."""
        return self.name.removesuffix(f"_{self.unit}")


def _a(*keys: str) -> str:
    return ", ".join(f"`{k}`" for k in keys)


_ASGI = "`instrumentation/server/asgi.py`"
# The aggregated budget's terms in TTFT order, then the parts of terms, then the P/D budget's own.
DECLARED: tuple[Term, ...] = (
    Term(
        "inbound_ms",
        "inbound (request bytes in the server's kernel → ingress)",
        "#4f6d8f",
        "server",
        _a(n.PL_INBOUND_MS),
        "ifNull(inbound_ms, 0)",
        "inbound_ms",
        starts="`arrived`: the kernel's receive stamp of the request's first bytes (`SO_TIMESTAMPNS`, peeked with "
        "`recvmsg(MSG_PEEK)` just before the event loop reads them; `instrumentation/hotpath/kernel_stamps.py`)",
        ends="`received`",
        clock_note="the kernel's realtime wait moved onto the monotonic clock as a duration",
        rollup_position=6,
        pd_position=1,
        pd_witness_position=21,
        observed_by="kernel_wait_ms",
    ),
    Term(
        "ingress_ms",
        "ingress",
        "#7aa6d8",
        "server",
        _a(n.PL_INGRESS_MS),
        "ingress_ms",
        "ingress_ms",
        starts=f"`received`: the ASGI middleware saw the request ({_ASGI}), or `telemetry.request(scope)` "
        "without middleware",
        ends="`enqueued`: the request was handed to the engine",
        rollup_position=7,
    ),
    Term(
        "queue_ms",
        "queue",
        "#f0a04b",
        "server",
        _a(n.PL_QUEUE_MS),
        "ttft_queue_ms",
        "ttft_queue_ms",
        starts="each wait: `enqueued` or `preempted`",
        ends="the next `scheduled`",
        rollup_position=8,
    ),
    Term(
        "prefill_ms",
        "prefill",
        "#5bb07a",
        "server",
        _a(n.PL_PREFILL_MS),
        "prefill_ms",
        "prefill_ms",
        starts="`scheduled₀`, the end of the first wait",
        ends="`prefill_end`: end of the last prefill chunk before the first token (`scheduled₀` when the loop "
        "reported no chunk)",
        rollup_position=9,
    ),
    Term(
        "first_token_ms",
        "first token",
        "#b07ad0",
        "server",
        _a(n.PL_FIRST_TOKEN_MS),
        "first_token_ms",
        "first_token_ms",
        starts="`prefill_end`",
        ends="`first_token`: the first sampled id is on the host (after `.tolist()` or a sync) and handed to the "
        "response stream",
        rollup_position=10,
    ),
    Term(
        "before_engine_ms",
        "before the engine (span model without ingress/first token)",
        "#d08a8a",
        "server",
        "server TTFT − ingress − queue − prefill, for a span model without a first-token term (native vLLM, SGLang)",
        "before_engine_ms",
        "before_engine_ms",
        rollup_position=11,
    ),
    Term(
        "held_back_ms",
        "held back (decode steps until the first visible text)",
        "#c9a0dc",
        "server",
        f"{_a(n.PL_HELD_BACK_MS)} (and {_a(n.PL_HELD_BACK_TOKENS)})",
        "ifNull(held_back_ms, 0)",
        "held_back_ms",
        starts="`first_token`",
        ends="`visible`: the decode step whose token made the first content visible (the API layer tells "
        "`output_ready(output_tokens)`; a byte-level token of an incomplete UTF-8 character renders none); "
        "= `first_token` when it did",
        rollup_position=12,
        observed_by="held_back_observed_ms",
    ),
    Term(
        "first_chunk_ms",
        "first chunk (server delivery)",
        "#e07b9a",
        "server",
        _a(n.PL_FIRST_CHUNK_MS),
        "ifNull(first_chunk_ms, 0)",
        "first_chunk_ms",
        starts="`visible`",
        ends="`first_chunk`: the first response body chunk that carries output is handed to the server's `send` "
        "(text or reasoning; a role-only chunk does not count), i.e. its bytes are with the server's transport "
        f"({_ASGI})",
        rollup_position=13,
        observed_by="loop_wait_ms",
    ),
    Term(
        "client_ms",
        "client (its own send and read of the first bytes)",
        "#8c7a5b",
        "client",
        _a(n.PL_CLIENT_SEND_MS, n.PL_CLIENT_READ_MS),
        "ifNull(client_ms, 0)",
        "client_ms",
        starts="`sent`",
        ends="the request's first bytes handed to the transport (less a new connection's handshake round trip), "
        "then again from the kernel's receive stamp of the first content bytes to their read",
        rollup_position=14,
        pd_position=2,
        pd_witness_position=22,
        observed_by="client_observed_ms",
    ),
    Term(
        "client_late_est_ms",
        "client late, estimate (its wait TCP's coalescing hid from the read)",
        "#c2b280",
        "server",
        f"inputs: {_a(n.PL_FIRST_SENDS_NS, n.PL_FIRST_SENDS_BODY_BYTES)} (server), "
        f"{_a(n.PL_CLIENT_READ_BODY_BYTES, n.PL_CLIENT_READ_COALESCED)} (client)",
        "ifNull(client_late_est_ms, 0)",
        "client_late_est_ms",
        starts="the first content chunk handed to `send`",
        ends="the chunk whose packet TCP stamped the client's read with handed to `send`",
        clock_note="a send gap standing for the client's arrival gap",
        estimate=True,
        rollup_position=41,
        pd_position=3,
        pd_witness_position=23,
        observed_by="client_late_est_observed_ms",
    ),
    Term(
        "residual_ms",
        "residual (network: what no stamp explains)",
        "#a9b0bc",
        "difference",
        "client TTFT − the server's TTFC − inbound − client − client_late_est",
        "residual_ms",
        "residual_ms",
        clock_note="of durations",
        rollup_position=15,
        pd_position=4,
    ),
    # parts of terms: first_chunk = loop_wait + encode (write beside it), inbound = kernel_wait + dispatch,
    # client = client_send + client_read
    *(
        Term(name, name, colour, clock, _a(key), name, name, in_ttft=False, rollup_position=pos, part_of=whole)
        for name, key, colour, clock, pos, whole in (
            ("loop_wait_ms", n.PL_FIRST_CHUNK_LOOP_WAIT_MS, "#e8a0b6", "server", 16, "first_chunk_ms"),
            ("encode_ms", n.PL_FIRST_CHUNK_ENCODE_MS, "#c85c80", "server", 17, "first_chunk_ms"),
        )
    ),
    Term(
        "write_ms",
        "write_ms",
        "#f2c4d2",
        "server",
        _a(n.PL_FIRST_CHUNK_WRITE_MS),
        "write_ms",
        "write_ms",
        in_ttft=False,
        rollup_position=18,
        part_of="first_chunk_ms",
        beside=True,
    ),
    *(
        Term(name, name, colour, clock, _a(key), name, name, in_ttft=False, rollup_position=pos, part_of=whole)
        for name, key, colour, clock, pos, whole in (
            ("kernel_wait_ms", n.PL_INBOUND_KERNEL_WAIT_MS, "#3b5570", "server", 19, "inbound_ms"),
            ("dispatch_ms", n.PL_INBOUND_DISPATCH_MS, "#7590b0", "server", 20, "inbound_ms"),
            ("client_send_ms", n.PL_CLIENT_SEND_MS, "#a89573", "client", 21, "client_ms"),
            ("client_read_ms", n.PL_CLIENT_READ_MS, "#6e5f45", "client", 22, "client_ms"),
        )
    ),
    # the P/D budget's own terms, in request order (analysis/schema/pd_schema.py holds their columns)
    *(
        Term(name, label, colour, clock, source, name, name, aggregated=False, pd_position=position)
        for position, (name, label, colour, clock, source) in enumerate(
            (
                ("router_ingress_ms", "router ingress", "#8893a5", "router", _a(n.PL_ROUTER_INGRESS_MS)),
                ("prefill_hop_ms", "prefill hop", "#c8ccd4", "difference", "router prefill call − prefill answer"),
                ("prefill_ingress_ms", "prefill ingress", "#7aa6d8", "prefill", _a(n.PL_INGRESS_MS)),
                ("prefill_queue_ms", "prefill queue", "#f0a04b", "prefill", _a(n.PL_QUEUE_MS)),
                ("prefill_compute_ms", "prefill compute", "#5bb07a", "prefill", _a(n.PL_PREFILL_MS)),
                ("prefill_first_token_ms", "prefill first token", "#b07ad0", "prefill", _a(n.PL_FIRST_TOKEN_MS)),
                ("kv_wait_ms", "KV wait", "#ecd08a", "prefill", _a(n.PL_KV_WAIT_MS)),
                ("kv_transfer_ms", "KV transfer", "#d9a441", "prefill", _a(n.PL_KV_TRANSFER_MS)),
                ("prefill_respond_ms", "prefill respond", "#8fd0a4", "prefill", _a(n.PL_PD_PREFILL_ANSWER_MS)),
                ("router_gap_ms", "router gap", "#6b7587", "router", _a(n.PL_ROUTER_GAP_MS)),
                ("decode_hop_ms", "decode hop", "#9aa1ad", "difference", "router decode first chunk − decode TTFC"),
                ("decode_ingress_ms", "decode ingress", "#9cc0e6", "decode", _a(n.PL_INGRESS_MS)),
                ("decode_queue_ms", "decode queue", "#f5c07e", "decode", _a(n.PL_QUEUE_MS)),
                ("decode_first_token_ms", "decode first token", "#8a55b0", "decode", _a(n.PL_FIRST_TOKEN_MS)),
                ("decode_first_chunk_ms", "decode first chunk", "#4f7fc0", "decode", _a(n.PL_FIRST_CHUNK_MS)),
                ("router_relay_ms", "router relay", "#4b5466", "router", _a(n.PL_ROUTER_RELAY_MS)),
            ),
            start=5,
        )
    ),
)


@dataclass(frozen=True, slots=True)
class Registry:
    """The lists every surface reads, built from one declarations tuple (checked on construction)."""

    declared: tuple[Term, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.declared]
        if len(set(names)) != len(names):
            raise ValueError(f"a term is declared twice: {sorted(x for x in names if names.count(x) > 1)}")
        for t in self.declared:
            if not t.name.endswith(f"_{t.unit}"):
                raise ValueError(f"term {t.name} does not end in its unit {t.unit}")
        for attr in ("rollup_position", "pd_position"):
            taken = [getattr(t, attr) for t in self.declared if getattr(t, attr) is not None]
            if len(set(taken)) != len(taken):
                raise ValueError(f"two terms share a {attr}")
        slots = [t.pd_position or 0 for t in self.pd_terms()] + [t.pd_witness_position or 0 for t in self.pd_gated()]
        if sorted(slots) != list(range(1, len(slots) + 1)):
            raise ValueError(f"P/D slots must run 1..{len(slots)} without a gap or a repeat: {slots}")

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.declared)

    def term(self, name: str) -> Term:
        return next(t for t in self.declared if t.name == name)

    def components(self) -> tuple[Term, ...]:
        """The aggregated budget's terms, in TTFT order."""
        return tuple(t for t in self.declared if t.aggregated and t.in_ttft)

    def parts(self, whole: str | None = None) -> tuple[Term, ...]:
        """The parts of terms (not in the sum; of `whole` only, if given), in declaration order."""
        return tuple(t for t in self.declared if not t.in_ttft and whole in (None, t.part_of))

    def pd_terms(self) -> tuple[Term, ...]:
        """The P/D budget's terms, in their order (`pd_position`: also their rollup slots)."""
        return tuple(sorted((t for t in self.declared if t.pd_position), key=lambda t: t.pd_position or 0))

    def pd_gated(self) -> tuple[Term, ...]:
        """The P/D terms counted 0 where a request did not stamp them (`sql` ≠ `column`), in the order
        of their witnesses' slots (`pd_witness_position`; one without is an error)."""
        gated = [t for t in self.pd_terms() if t.sql != t.column]
        missing = [t.name for t in gated if t.pd_witness_position is None]
        if missing:
            raise ValueError(f"a P/D term counted 0 where unstamped needs a pd_witness_position: {missing}")
        return tuple(sorted(gated, key=lambda t: t.pd_witness_position or 0))

    def estimated(self) -> frozenset[str]:
        return frozenset(t.name for t in self.declared if t.estimate)

    def observed_by(self) -> dict[str, str]:
        """Component → the distribution whose NULL mean marks it unobserved (it counts 0 in the rows)."""
        return {t.name: t.observed_by for t in self.components() if t.observed_by}

    def witnesses(self) -> tuple[tuple[str, str], ...]:
        """The witness distributions that are not terms themselves: (name, the term's column)."""
        names = self.names()
        return tuple(
            (t.observed_by, t.column) for t in self.components() if t.observed_by and t.observed_by not in names
        )

    def rollup_positions(self) -> dict[str, int]:
        return {t.name: t.rollup_position for t in self.declared if t.rollup_position is not None}


REGISTRY = Registry(DECLARED)


def docs_table(registry: Registry | None = None) -> str:
    """The term table of docs/budget-method.md#the-terms: the aggregated budget's terms, in TTFT order."""
    registry = registry or REGISTRY
    rows = [
        "| term | starts at | ends at | clock | span attribute (ms) | view column |",
        "|---|---|---|---|---|---|",
    ]
    for t in registry.components():
        name = f"{t.stem} (**estimate**)" if t.estimate else t.stem
        clock = f"{t.clock} ({t.clock_note})" if t.clock_note else t.clock
        parts = [p for p in registry.parts() if p.part_of == t.name and not p.beside]
        column = f"`{t.column}`" + (" = " + " + ".join(f"`{p.column}`" for p in parts) if parts else "")
        rows.append(f"| {name} | {t.starts} | {t.ends} | {clock} | {t.source} | {column} |")
    return "\n".join(rows) + "\n"
