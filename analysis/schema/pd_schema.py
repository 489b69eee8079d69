"""The per-request tables of disaggregated serving (docs/disaggregation.md#the-budget-across-machines).

One request's trace holds three span trees, each emitted on its own host's clock: the router's
(resource `phaselens.pd.role` = router), the prefill instance's and the decode instance's. The
generic parts table (analysis.schema.schema) reads the router's tree and the client's only; this module's
parts table `phaselens_pd_parts` folds the P/D instances' spans (and the router's P/D terms) per
TraceId, and the view `phaselens_pd_requests` turns them into budget terms. Every term is a
duration on ONE clock; a hop between hosts is a residual of two durations, never of timestamps:

    prefill_hop_ms  = router's pd.prefill_call (router clock) − the prefill instance's received → answer
                      built (`phaselens.pd.prefill_answer_ms`, prefill clock)
    decode_hop_ms   = router's decode_first_chunk (router clock) − the decode instance's server TTFC (decode clock)
    prefill_respond_ms = prefill_answer − (ingress + queue + prefill + first_token + kv_wait + kv_transfer)
                         (prefill clock: the acknowledgement → the answer built: the engine loop
                         taking the release, the event loop taking the final output)

For vLLM instances with the plugin and a timed KV connector (integrations/vllm/kv_connector.py) the
KV moves inside the engine steps: the save (`llm.kv_save`, prefill clock) inside the prefill's
forward pass, the load (`llm.kv_load`, decode clock) inside the decode instance's first step. They
are taken out of those terms and make the transfer:

    kv_transfer_ms         = save + load                     (each on its own clock)
    prefill_compute_ms     = prefill − save                  (prefill clock)
    decode_first_token_ms  = prefill + first_token − load    (decode clock)
    kv_wait_ms             = 0 (nothing between the first token and a save that ran before it)
    prefill_answer         = the prefill instance's server TTFC (its whole JSON answer handed to `send`)

Each callee duration ends where its bytes are handed on (an answer built, a chunk handed to `send`),
not where `send` returned: the caller may read them before the callee's coroutine resumes, and a
hop would then come out negative.

and, exactly (each bracket one clock; docs/disaggregation.md):

    client TTFT = residual_ms                                          (client − router TTFC)
                + router_ingress_ms + router_gap_ms + router_relay_ms  (router)
                + prefill_hop_ms + decode_hop_ms                       (hops: residuals of durations)
                + prefill_ingress_ms + prefill_queue_ms + prefill_compute_ms + prefill_first_token_ms
                + kv_wait_ms + kv_transfer_ms + prefill_respond_ms     (prefill)
                + decode_ingress_ms + decode_queue_ms + decode_first_token_ms + decode_first_chunk_ms (decode)
"""

from __future__ import annotations

from phaselens.analysis import terms
from phaselens.analysis.schema.parts import Part, attr, num, select_list
from phaselens.collectors.schema import DEDUP_WINDOW_BLOCKS, TRACES_TABLE, distributed_engine, ident
from phaselens.instrumentation import names as n

PD_PARTS_TABLE = "phaselens_pd_parts"
PD_PARTS_MV = f"{PD_PARTS_TABLE}_mv"
PD_PARTS_DISTRIBUTED = f"{PD_PARTS_TABLE}_distributed"  # on a cluster: what the view reads
PD_REQUESTS_VIEW = "phaselens_pd_requests"
ROLES = ("router", "prefill", "decode")
INSTANCE_ROLES = ("prefill", "decode")  # their spans stay out of the generic parts (schema.OUTSIDE_PD_INSTANCES)

ROLE = f"ResourceAttributes['{n.PL_PD_ROLE}']"
IS_SERVER_SPAN = "SpanKind IN ('Server', 'SPAN_KIND_SERVER')"


def _role_attr(column: str, role: str, key: str) -> Part:
    """A numeric attribute of the role's SERVER span (the phase terms are attributes of it)."""
    cond = f"{ROLE} = '{role}' AND {IS_SERVER_SPAN}"
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)}, {cond})")


def _role_any(column: str, role: str, key: str) -> Part:
    """A numeric attribute of any of the role's spans (the ITL figures are on `llm.decode`)."""
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)}, {ROLE} = '{role}')")


def _span_attr(column: str, span: str, key: str) -> Part:
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)}, SpanName = '{span}')")


def _role_span_attr(column: str, role: str, span: str, key: str) -> Part:
    """A numeric attribute of the role's span `span` (a decode instance's connector may also save)."""
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)}, {ROLE} = '{role}' AND SpanName = '{span}')")


def _instance(column: str, role: str) -> Part:
    cond = f"{ROLE} = '{role}'"
    value = f"toNullable(ResourceAttributes['{n.PL_PD_INSTANCE}'])"
    return Part(column, "any", "Nullable(String)", f"any(if({cond}, {value}, NULL))")


# SGLang's P/D request traces (docs/disaggregation.md#sglang): no phaselens resource attributes; each
# instance's TokenizerManager opens a root `{role} Req {rid[:8]}` and its scheduler the slices, every
# duration on that instance's clock. Its instance: `phaselens.pd.instance` when OTEL_RESOURCE_ATTRIBUTES
# sets it, else the service name (`--otlp-service-name`).
_SG_ROOT = f"{attr(n.SGLANG_MODULE)} = '{n.SGLANG_REQUEST_MODULE}'"
_SG_INSTANCE = f"toNullable(coalesce(nullIf(ResourceAttributes['{n.PL_PD_INSTANCE}'], ''), toString(ServiceName)))"
SG_SLICES = (
    n.SPAN_SGLANG_PREFILL_PREPARE,
    n.SPAN_SGLANG_PREFILL_BOOTSTRAP,
    n.SPAN_SGLANG_QUEUE,
    n.SPAN_SGLANG_PREFILL,
    n.SPAN_SGLANG_KV_TRANSFER,
    n.SPAN_SGLANG_DECODE_PREPARE,
    n.SPAN_SGLANG_DECODE_BOOTSTRAP,
    n.SPAN_SGLANG_DECODE_TRANSFERRED,
    n.SPAN_SGLANG_DECODE_QUEUE,
    n.SPAN_SGLANG_DECODE_FIRST_TOKEN,
)


def _sg_root(role: str) -> str:
    return f"startsWith(SpanName, '{role} Req ') AND {_SG_ROOT}"


def _sg_instance(role: str) -> Part:
    return Part(f"sg_{role[0]}_instance", "any", "Nullable(String)", f"any(if({_sg_root(role)}, {_SG_INSTANCE}, NULL))")


def _sg_ingress(role: str) -> Part:
    """The TokenizerManager's created → dispatched: TTFT − time_in_model_prefill (s, one process's clock)."""
    ms = f"({num(n.LATENCY_TIME_TO_FIRST_TOKEN)} - {num(n.LATENCY_TIME_IN_MODEL_PREFILL)}) * 1000"
    return Part(f"sg_{role[0]}_ingress", "max", "Nullable(Float64)", f"maxIf({ms}, {_sg_root(role)})")


def _sg_slice(column: str, span: str) -> Part:
    """A slice's duration in ms (a recompute after a retraction repeats prefill_forward: the longest)."""
    return Part(column, "max", "Nullable(Float64)", f"maxIf(toNullable(Duration) / 1e6, SpanName = '{span}')")


def _vllm(column: str, role: str, key: str) -> Part:
    """A de-facto key (s) of vLLM's `llm_request` on an instance tagged with its role through
    OTEL_RESOURCE_ATTRIBUTES (docs/disaggregation.md#vllm), in ms on that instance's clock."""
    cond = f"{ROLE} = '{role}' AND SpanName = '{n.SPAN_VLLM_REQUEST}'"
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)} * 1000, {cond})")


def _sg(role: str, column: str) -> str:
    """An SGLang slice's column, NULL unless the trace holds that role's P/D root (the queue and
    prefill slices of a colocated SGLang request carry the same names)."""
    return f"if(sg_{role[0]}_instance IS NULL, NULL, {column})"


# Dynamo's P/D workers (docs/disaggregation.md#dynamo): one `engine.generate` per request per worker,
# its role in `disagg_role`, its figures ms strings on that worker's clock. Its instance:
# `phaselens.pd.instance` when set, else the service name (OTEL_SERVICE_NAME).
def _dy_span(role: str) -> str:
    return f"SpanName = '{n.SPAN_DYNAMO_ENGINE_GENERATE}' AND {attr(n.DYNAMO_DISAGG_ROLE)} = '{role}'"


def _dy_instance(role: str) -> Part:
    return Part(f"dy_{role[0]}_instance", "any", "Nullable(String)", f"any(if({_dy_span(role)}, {_SG_INSTANCE}, NULL))")


def _dy(column: str, role: str, key: str) -> Part:
    return Part(column, "max", "Nullable(Float64)", f"maxIf({num(key)}, {_dy_span(role)})")


# Dynamo 1.6.1's live spans (docs/disaggregation.md#dynamo): the frontend's `http-request` and its
# calls to the workers (`router.route_request`, frontend clock), each worker's `handle_payload`
# (worker clock). A prefill worker's `handle_payload` has component `prefill`; the frontend's call to
# it is the route without a migration count.
DY_REQUEST = f"SpanName = '{n.SPAN_DYNAMO_HTTP_REQUEST}' AND {attr(n.DYNAMO_TARGET)} = '{n.DYNAMO_REQUEST_SPAN_TARGET}'"
_DY_ROUTE = f"SpanName = '{n.SPAN_DYNAMO_ROUTE}'"
_DY_HANDLE = f"SpanName = '{n.SPAN_DYNAMO_HANDLE}' AND {attr(n.DYNAMO_TARGET)} = '{n.DYNAMO_REQUEST_SPAN_TARGET}'"
_DY_WORKER = {
    "prefill": f"{_DY_HANDLE} AND {attr(n.DYNAMO_COMPONENT)} = '{n.DYNAMO_PREFILL_COMPONENT}'",
    "decode": f"{_DY_HANDLE} AND {attr(n.DYNAMO_COMPONENT)} != '{n.DYNAMO_PREFILL_COMPONENT}'",
}
_DY_PREFILL_ROUTE = f"{_DY_ROUTE} AND NOT mapContains(SpanAttributes, '{n.DYNAMO_MIGRATION_TOKENS}')"


def _dw_instance(role: str) -> Part:
    cond = _DY_WORKER[role]
    return Part(f"dw_{role[0]}_instance", "any", "Nullable(String)", f"any(if({cond}, {_SG_INSTANCE}, NULL))")


def _dw_ms(column: str, cond: str, value: str = "toNullable(Duration)") -> Part:
    """ms of a Dynamo span's Duration (or an ns attribute) where `cond` holds, on that span's clock."""
    return Part(column, "max", "Nullable(Float64)", f"maxIf({value} / 1e6, {cond})")


def _dw_start(column: str, cond: str) -> Part:
    return Part(column, "min", "Nullable(DateTime64(9))", f"minIf(toNullable(Timestamp), {cond})")


DYNAMO_LIVE_PARTS: tuple[Part, ...] = (
    *(_dw_instance(role) for role in ("prefill", "decode")),
    _dw_start("dw_request_start", DY_REQUEST),
    _dw_start("dw_route_start", _DY_ROUTE),
    _dw_ms("dw_ttft", DY_REQUEST, f"{num(n.DYNAMO_TTFT_MS)} * 1e6"),
    _dw_ms("dw_prefill_call", _DY_PREFILL_ROUTE),
    _dw_ms("dw_p_worker", _DY_WORKER["prefill"]),
    *(
        _dw_ms(f"dw_{role[0]}_{kind}", _DY_WORKER[role], num(key))
        for role in ("prefill", "decode")
        for kind, key in (("busy", n.DYNAMO_BUSY_NS), ("idle", n.DYNAMO_IDLE_NS))
    ),
)
IS_DYNAMO_PD = (
    f"SpanName = '{n.SPAN_DYNAMO_ENGINE_GENERATE}' AND {attr(n.DYNAMO_DISAGG_ROLE)} IN "
    f"({', '.join(repr(r) for r in n.DYNAMO_PD_ROLES)}) OR ({DY_REQUEST}) OR ({_DY_ROUTE}) OR ({_DY_HANDLE})"
)


def _dw(column: str) -> str:
    """A column of Dynamo's live spans, NULL unless the request went through a prefill worker."""
    return f"if(dw_p_instance IS NULL, NULL, {column})"


# Dynamo's frontend TTFT in terms, all on the frontend's clock (docs/disaggregation.md#dynamo):
#     frontend TTFT = frontend_dispatch + prefill_call + kv_transfer_est
# (kv_transfer_est: the prefill's answer back → the first token at the frontend, an estimate). No
# prefill hop: the prefill worker's `handle_payload` ends after the frontend's call did (the stream's
# teardown), so call − handle_payload comes out negative.
DYNAMO_DISPATCH_MS = "(toUnixTimestamp64Nano(dw_route_start) - toUnixTimestamp64Nano(dw_request_start)) / 1e6"
DYNAMO_KV_EST_MS = f"dw_ttft - ({DYNAMO_DISPATCH_MS}) - dw_prefill_call"


_PHASES = (
    ("ingress", n.PL_INGRESS_MS),
    ("queue", n.PL_QUEUE_MS),
    ("prefill", n.PL_PREFILL_MS),
    ("first_token", n.PL_FIRST_TOKEN_MS),
    ("first_chunk", n.PL_FIRST_CHUNK_MS),
    ("ttfc", n.PL_SERVER_TTFC_MS),
)
_ROUTER_TERMS = {
    "r_ingress": n.PL_ROUTER_INGRESS_MS,
    "r_prefill_call": n.PL_ROUTER_PREFILL_CALL_MS,
    "r_gap": n.PL_ROUTER_GAP_MS,
    "r_decode_first_chunk": n.PL_ROUTER_DECODE_FIRST_CHUNK_MS,
    "r_relay": n.PL_ROUTER_RELAY_MS,
    "r_ttfc": n.PL_SERVER_TTFC_MS,
}

PD_PARTS: tuple[Part, ...] = (
    *(_instance(f"{role[0]}_instance", role) for role in ROLES),
    *(_role_attr(col, "router", key) for col, key in _ROUTER_TERMS.items()),
    *(_role_attr(f"{role[0]}_{phase}", role, key) for role in INSTANCE_ROLES for phase, key in _PHASES),
    _span_attr("p_answer", n.SPAN_KV_TRANSFER, n.PL_PD_PREFILL_ANSWER_MS),
    _role_attr("d_held_back", "decode", n.PL_HELD_BACK_MS),
    _role_any("d_itl_p99", "decode", n.PL_ITL_P99_MS),
    _role_any("d_stall", "decode", n.PL_STALL_MS),
    _span_attr("kv_wait", n.SPAN_KV_TRANSFER, n.PL_KV_WAIT_MS),
    _span_attr("kv_transfer", n.SPAN_KV_TRANSFER, n.PL_KV_TRANSFER_MS),
    _span_attr("kv_sent_bytes", n.SPAN_KV_TRANSFER, n.PL_KV_BYTES),
    _span_attr("kv_recv_bytes", n.SPAN_KV_RECEIVE, n.PL_KV_BYTES),
    _role_span_attr("kv_save", "prefill", n.SPAN_KV_SAVE, n.PL_KV_SAVE_MS),
    _role_span_attr("kv_load", "decode", n.SPAN_KV_LOAD, n.PL_KV_LOAD_MS),
    _role_span_attr("kv_save_bytes", "prefill", n.SPAN_KV_SAVE, n.PL_KV_BYTES),
    _role_span_attr("kv_load_bytes", "decode", n.SPAN_KV_LOAD, n.PL_KV_BYTES),
    Part("kv_recv_ns", "max", "Nullable(UInt64)", f"maxIf(toNullable(Duration), SpanName = '{n.SPAN_KV_RECEIVE}')"),
    Part("pd_error", "max", "UInt8", "max(StatusCode IN ('Error', 'STATUS_CODE_ERROR'))"),
    *(_sg_instance(role) for role in n.SGLANG_PD_ROLES),
    *(_sg_ingress(role) for role in n.SGLANG_PD_ROLES),
    _sg_slice("sg_p_prepare", n.SPAN_SGLANG_PREFILL_PREPARE),
    _sg_slice("sg_p_bootstrap", n.SPAN_SGLANG_PREFILL_BOOTSTRAP),
    _sg_slice("sg_p_queue", n.SPAN_SGLANG_QUEUE),
    _sg_slice("sg_p_forward", n.SPAN_SGLANG_PREFILL),
    _sg_slice("sg_kv_transfer", n.SPAN_SGLANG_KV_TRANSFER),
    _sg_slice("sg_d_prepare", n.SPAN_SGLANG_DECODE_PREPARE),
    _sg_slice("sg_d_bootstrap", n.SPAN_SGLANG_DECODE_BOOTSTRAP),
    _sg_slice("sg_d_transferred", n.SPAN_SGLANG_DECODE_TRANSFERRED),
    _sg_slice("sg_d_queue", n.SPAN_SGLANG_DECODE_QUEUE),
    _sg_slice("sg_d_first_token", n.SPAN_SGLANG_DECODE_FIRST_TOKEN),
    _vllm("v_p_queue", "prefill", n.LATENCY_TIME_IN_QUEUE),
    _vllm("v_p_prefill", "prefill", n.LATENCY_TIME_IN_MODEL_PREFILL),
    _vllm("v_d_first_token", "decode", n.LATENCY_TIME_IN_MODEL_PREFILL),  # scheduled (KV in) → first token
    *(_dy_instance(role) for role in n.DYNAMO_PD_ROLES),
    _dy("dy_p_engine_ttft", "prefill", n.DYNAMO_TTFT_MS),
    _dy("dy_d_engine_ttft", "decode", n.DYNAMO_TTFT_MS),
    _dy("dy_d_itl_p99", "decode", n.DYNAMO_ITL_P99_MS),
    *DYNAMO_LIVE_PARTS,
)

_PD_SPAN_MODEL = (
    "multiIf((v_p_prefill IS NOT NULL OR v_d_first_token IS NOT NULL) AND p_ingress IS NULL AND d_ingress IS NULL, "
    f"'{n.SPAN_MODEL_VLLM}', "
    f"p_instance IS NOT NULL OR d_instance IS NOT NULL, '{n.SPAN_MODEL_PHASELENS}', "
    f"sg_p_instance IS NOT NULL OR sg_d_instance IS NOT NULL, '{n.SPAN_MODEL_SGLANG}', "
    f"dy_p_instance IS NOT NULL OR dy_d_instance IS NOT NULL OR dw_p_instance IS NOT NULL, '{n.SPAN_MODEL_DYNAMO}', NULL)"
)
# vLLM's KV connector (llm.kv_save / llm.kv_load, the plugin's): the save runs inside the forward pass
# that makes the first token, so no wait follows the first token (0, observed by construction); the
# answer is the prefill half's whole JSON answer handed to `send` (its server TTFC)
_VLLM_KV_WAIT = "if(kv_save IS NULL, NULL, 0)"
_P_ANSWER = "coalesce(p_answer, p_ttfc)"
_REFERENCE_RESPOND = "p_answer - (p_ingress + p_queue + p_prefill + p_first_token + kv_wait + kv_transfer)"
_VLLM_RESPOND = "p_ttfc - (p_ingress + p_queue + p_prefill + p_first_token)"
# (column, expression over the merged parts), in the order `phaselens_requests` appends them
PD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("prefill_instance", "coalesce(p_instance, sg_p_instance, dy_p_instance, dw_p_instance)"),
    ("decode_instance", f"coalesce(d_instance, sg_d_instance, dy_d_instance, {_dw('dw_d_instance')})"),
    ("kv_transfer_ms", f"coalesce(kv_transfer, {_sg('prefill', 'sg_kv_transfer')}, kv_save + kv_load)"),
    ("kv_bytes", "CAST(coalesce(kv_sent_bytes, kv_save_bytes) AS Nullable(UInt64))"),
    ("kv_bytes_received", "CAST(coalesce(kv_recv_bytes, kv_load_bytes) AS Nullable(UInt64))"),
    ("kv_wait_ms", f"coalesce(kv_wait, {_VLLM_KV_WAIT})"),
    ("kv_receive_ms", "kv_recv_ns / 1e6"),
    ("router_ingress_ms", "r_ingress"),
    ("router_gap_ms", "r_gap"),
    ("router_relay_ms", "r_relay"),
    ("router_ttfc_ms", "r_ttfc"),
    ("prefill_hop_ms", f"r_prefill_call - {_P_ANSWER}"),
    ("decode_hop_ms", "r_decode_first_chunk - d_ttfc"),
    ("prefill_ingress_ms", f"coalesce(p_ingress, {_sg('prefill', 'sg_p_ingress + sg_p_prepare')})"),
    ("prefill_queue_ms", f"coalesce(p_queue, {_sg('prefill', 'sg_p_queue')}, v_p_queue)"),
    (
        "prefill_compute_ms",
        f"coalesce(p_prefill - coalesce(kv_save, 0), {_sg('prefill', 'sg_p_forward')}, v_p_prefill)",
    ),
    ("prefill_first_token_ms", "p_first_token"),
    (
        "prefill_respond_ms",
        f"coalesce({_REFERENCE_RESPOND}, {_VLLM_RESPOND})",
    ),
    ("decode_ingress_ms", f"coalesce(d_ingress, {_sg('decode', 'sg_d_ingress + sg_d_prepare')})"),
    ("decode_queue_ms", f"coalesce(d_queue, {_sg('decode', 'sg_d_queue')})"),
    # no prefill on a decode instance: d_prefill = 0
    (
        "decode_first_token_ms",
        f"coalesce(d_prefill + d_first_token - coalesce(kv_load, 0), {_sg('decode', 'sg_d_first_token')}, v_d_first_token)",
    ),
    # the decode steps whose tokens rendered no text (vLLM's byte-level tokens) come before the first chunk
    ("decode_first_chunk_ms", "d_first_chunk + ifNull(d_held_back, 0)"),
    ("decode_itl_p99_ms", "coalesce(d_itl_p99, dy_d_itl_p99)"),
    ("decode_stall_ms", "d_stall"),
    ("prefill_bootstrap_ms", _sg("prefill", "sg_p_bootstrap")),
    ("decode_bootstrap_ms", _sg("decode", "sg_d_bootstrap")),
    ("decode_kv_wait_ms", f"coalesce({_sg('decode', 'sg_d_transferred')}, kv_load)"),
    ("prefill_engine_ttft_ms", "dy_p_engine_ttft"),
    ("decode_engine_ttft_ms", "dy_d_engine_ttft"),
    ("frontend_dispatch_ms", _dw(DYNAMO_DISPATCH_MS)),
    ("prefill_call_ms", _dw("dw_prefill_call")),
    ("prefill_worker_ms", "dw_p_worker"),
    ("kv_transfer_est_ms", _dw(DYNAMO_KV_EST_MS)),
    ("prefill_busy_ms", "dw_p_busy"),
    ("prefill_idle_ms", "dw_p_idle"),
    ("decode_busy_ms", _dw("dw_d_busy")),
    ("decode_idle_ms", _dw("dw_d_idle")),
    ("pd_span_model", _PD_SPAN_MODEL),
)
PD_COLUMN_NAMES = tuple(name for name, _ in PD_COLUMNS)
# The P/D budget terms that sum (with the generic edges and residual_ms) to client TTFT, in request
# order (analysis/terms.py declares them).
PD_TERMS = tuple(t.name for t in terms.REGISTRY.pd_terms() if not t.aggregated)


# the instances' roots carry the de-facto latency keys: they stay out of the generic parts (analysis.schema.schema)
# startsWith, not a regex: the generic parts' view evaluates this for every span it reads
_SG_PD_ROOT_NAME = " OR ".join(f"startsWith(SpanName, '{role} Req ')" for role in n.SGLANG_PD_ROLES)
IS_SGLANG_PD_ROOT = f"({_SG_PD_ROOT_NAME}) AND {_SG_ROOT}"
IS_SGLANG_PD = f"SpanName IN ({', '.join(repr(s) for s in SG_SLICES)}) OR ({IS_SGLANG_PD_ROOT})"


def pd_parts_select(traces: str) -> str:
    cols = ",\n    ".join(f"{p.insert_expr} AS {p.column}" for p in PD_PARTS)
    return (
        f"SELECT TraceId,\n    {cols}\nFROM {traces}\n"
        f"WHERE ({ROLE} != '' AND SpanName != '{n.SPAN_ENGINE_STEP}' OR ({IS_SGLANG_PD}) OR ({IS_DYNAMO_PD}))"
        " AND TraceId != ''\n"
        "GROUP BY TraceId"
    )


def statements(
    database: str = "otel", ttl_clause: str = "", cluster: str | None = None, on_cluster: bool = True
) -> list[str]:
    """CREATE statements (idempotent) of the P/D parts table, its materialized view and the view,
    after analysis.schema.schema's (`ttl_clause`, `cluster` and `on_cluster` as for the generic parts table:
    on a cluster the parts are per shard, fed from the local `otel_traces` (a request's spans meet on
    one shard), and the view reads them through a Distributed table)."""
    db = ident(database)
    replicated = bool(cluster) and on_cluster
    on = f" ON CLUSTER {ident(cluster)}" if cluster and replicated else ""
    engine = "ReplicatedAggregatingMergeTree()" if replicated else "AggregatingMergeTree()"
    dedup = "" if replicated else f"\nSETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW_BLOCKS}"
    parts, traces = f"{db}.{ident(PD_PARTS_TABLE)}", f"{db}.{ident(TRACES_TABLE)}"
    parts_read = f"{db}.{ident(PD_PARTS_DISTRIBUTED)}" if cluster else parts
    cols = ",\n    ".join(p.ddl() for p in PD_PARTS)
    add = ",\n    ".join(f"ADD COLUMN IF NOT EXISTS {p.ddl()}" for p in PD_PARTS)
    out = [
        (
            f"CREATE TABLE IF NOT EXISTS {parts}{on} (\n    TraceId String CODEC(ZSTD(1)),\n    {cols}\n)"
            f" ENGINE = {engine}\nORDER BY TraceId{ttl_clause}{dedup}"
        ),
        f"ALTER TABLE {parts}{on}\n    {add}",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{ident(PD_PARTS_MV)}{on} TO {parts}\nAS {pd_parts_select(traces)}",
        f"ALTER TABLE {db}.{ident(PD_PARTS_MV)}{on} MODIFY QUERY {pd_parts_select(traces)}",
    ]
    if cluster:
        distributed = distributed_engine(cluster, database, PD_PARTS_TABLE)
        out += [
            f"CREATE TABLE IF NOT EXISTS {parts_read}{on} AS {parts}\nENGINE = {distributed}",
            f"ALTER TABLE {parts_read}{on}\n    {add}",
        ]
    out.append(f"CREATE OR REPLACE VIEW {db}.{ident(PD_REQUESTS_VIEW)}{on} AS\n{pd_requests_select(parts_read)}")
    return out


def pd_requests_select(parts: str, where: str = "1", names: tuple[str, ...] = PD_COLUMN_NAMES) -> str:
    """The P/D columns `names` per trace (`trace_id`) from the P/D parts `parts` (rows matching
    `where`), merged with FINAL: the view's query, and the rollup's (analysis.rollup.rollup) over a node's
    own parts, with the columns it needs only (ClickHouse analyses every expression of a query)."""
    columns = tuple(c for c in PD_COLUMNS if c[0] in names)
    return f"SELECT\n    TraceId AS trace_id,\n    {select_list(columns)}\nFROM {parts} FINAL\nWHERE {where}"


def requests_columns() -> str:
    """The P/D columns as `phaselens_requests` appends them (NULL for a colocated request)."""
    return ", ".join(f"pd.{name} AS {name}" for name in PD_COLUMN_NAMES)


def requests_join(database: str) -> str:
    """What `phaselens_requests` appends: the P/D columns of its trace, NULL for a colocated request."""
    return f"LEFT JOIN {ident(database)}.{ident(PD_REQUESTS_VIEW)} AS pd USING (trace_id)"
