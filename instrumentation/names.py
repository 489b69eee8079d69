"""Span names, attribute keys and metric names: the one source of truth of the data contract.

Every producer (server, client), the analysis SQL and the dashboards import names from here.
Changing a value here changes the contract: update docs/span-model.md, dashboards and tests together.
"""

# --- span names -----------------------------------------------------------------------------
SPAN_INGRESS = "llm.ingress"
SPAN_QUEUE = "llm.queue"
SPAN_PREFILL = "llm.prefill"
SPAN_PREFILL_CHUNK = "llm.prefill.chunk"
SPAN_FIRST_TOKEN = "llm.first_token"
SPAN_FIRST_CHUNK = "llm.first_chunk"  # first token handed to the stream → its chunk handed to the server's send
SPAN_DECODE = "llm.decode"
SPAN_DELIVERY = "llm.delivery"
SPAN_ENGINE_STEP = "llm.engine_step"
# Disaggregated prefill/decode (docs/disaggregation.md): each on the clock of the instance that emits it
SPAN_KV_TRANSFER = "llm.kv_transfer"  # prefill instance: send start → the decode instance's acknowledgement
SPAN_KV_RECEIVE = "llm.kv_receive"  # decode instance: connection accepted → KV written into its pool, ack sent
# a vLLM instance's KV connector, timed by the plugin (integrations/vllm/kv_connector.py), child of its SERVER span
SPAN_KV_SAVE = "llm.kv_save"  # prefill instance: the connector's first save call → its last (inside llm.prefill)
SPAN_KV_LOAD = "llm.kv_load"  # decode instance: the connector's first load call → its last (inside llm.prefill)
SPAN_PD_PREFILL_CALL = "pd.prefill_call"  # router, CLIENT: request to the prefill instance → its answer
SPAN_PD_DECODE_CALL = "pd.decode_call"  # router, CLIENT: request to the decode instance → its stream's end

SERVER_SERVICE_NAME = "phaselens-server"  # service.name of a phaselens server when OTEL_SERVICE_NAME sets none
VLLM_SERVICE_NAME = "vllm"  # service.name of vLLM with the phaselens plugin when OTEL_SERVICE_NAME sets none

# The phases of every request that reached its first token; llm.first_chunk only where a streamed
# response told the handle which body chunk carries output (`output_ready()`).
PHASE_SPANS = (SPAN_INGRESS, SPAN_QUEUE, SPAN_PREFILL, SPAN_FIRST_TOKEN, SPAN_DECODE, SPAN_DELIVERY)
SERVER_SCOPE = "phaselens.instrumentation"  # tracer/meter scope (ScopeName) of the server spans

OP_TEXT_COMPLETION = "text_completion"
OP_CHAT = "chat"


def root_span_name(operation: str, model: str) -> str:
    """`{gen_ai.operation.name} {model}`, the name of both the SERVER and the CLIENT span."""
    return f"{operation} {model}"


# --- client span events ---------------------------------------------------------------------
EVENT_FIRST_CHUNK = "first_chunk"
EVENT_FIRST_OUTPUT = "first_output"
EVENT_LAST_CHUNK = "last_chunk"
EVENT_TOKEN = "token"  # per-token events on llm.decode, only with PHASELENS_TOKEN_EVENTS=1

# --- GenAI semantic conventions -------------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS = "gen_ai.usage.reasoning.output_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"  # content: only with capture opt-in
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
# semconv `http.request.header.<key>` (string[]): the harness's request id, X-Request-ID as received
# (AIPerf, `vllm bench serve` and others send it; `phaselens import` joins their records on it)
HTTP_REQUEST_HEADER_X_REQUEST_ID = "http.request.header.x-request-id"
X_REQUEST_ID_HEADER = "x-request-id"
X_REQUEST_ID_MAX_CHARS = 256  # a longer value is cut: the header is the client's to fill
ERROR_CLIENT_DISCONNECTED = "client_disconnected"  # error.type value: the client went away

PROVIDER_PHASELENS = "phaselens"

# --- de-facto engine keys shared by vLLM, SGLang and TensorRT-LLM (seconds, float) ----------
GEN_AI_REQUEST_ID = "gen_ai.request.id"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
# vLLM's native span (one SERVER span per request, phases as the keys above) and its usage keys
SPAN_VLLM_REQUEST = "llm_request"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
# Span models: which producer's spans a request row was built from (view column `span_model`)
SPAN_MODEL_PHASELENS = "phaselens"  # the phaselens tree: reference server, or vLLM with the plugin
SPAN_MODEL_VLLM = "vllm-native"  # vLLM's own `llm_request` span
SPAN_MODEL_ENGINE_KEYS = "engine-keys"  # another SERVER span with only the de-facto keys
SPAN_MODEL_SGLANG = "sglang-native"  # SGLang's own request trace (`Req …` root, scheduler slices)
SPAN_MODEL_TGI = "tgi-native"  # TGI's own request span (durations as Rust `Duration` Debug strings)
SPAN_MODEL_DYNAMO = "dynamo-native"  # Dynamo's spans: the frontend's `http-request` and its workers' (`engine.generate` or `handle_payload`)
# SGLang's native spans (sglang 0.5.23, sglang/srt/observability): an INTERNAL root `{role} Req {rid[:8]}`
# with the keys above at its end, thread spans under it, and one span per stage ("slice")
SGLANG_RID = "rid"  # root attribute: the request id
SGLANG_MODULE = "module"  # root attribute, `sglang::request` (SGLANG_REQUEST_MODULE) on a request's root
SGLANG_REQUEST_MODULE = "sglang::request"
GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"  # SGLang's prefix-cache hits
SPAN_SGLANG_QUEUE = "prefill_waiting"  # scheduler: waiting queue entry → first forward
SPAN_SGLANG_PREFILL = "prefill_forward"  # scheduler: first forward → prefill finished (first token sampled)
SPAN_SGLANG_PREFILL_CHUNK = "chunked_prefill"  # one per chunk of a chunked prefill, under prefill_forward
# SGLang's P/D slices (sglang 0.5.23 req_time_stats.py, RequestStage): the prefill instance's root is
# `prefill Req …`, the decode instance's `decode Req …` (SGLANG_PD_ROLES), each on its own host's clock
SGLANG_PD_ROLES = ("prefill", "decode")
SPAN_SGLANG_PREFILL_PREPARE = "prefill_prepare"  # prefill scheduler: received → bootstrap queue
SPAN_SGLANG_PREFILL_BOOTSTRAP = "prefill_bootstrap"  # bootstrap queue → waiting queue (handshake with decode)
SPAN_SGLANG_KV_TRANSFER = "prefill_transfer_kv_cache"  # last KV chunk handed to the sender → transfer done (polled)
SPAN_SGLANG_DECODE_PREPARE = "decode_prepare"  # decode scheduler: received → prealloc queue
SPAN_SGLANG_DECODE_BOOTSTRAP = "decode_bootstrap"  # prealloc queue → transfer queue (handshake, KV allocated)
SPAN_SGLANG_DECODE_TRANSFERRED = "decode_transferred"  # transfer queue → waiting queue (the KV arrived)
SPAN_SGLANG_DECODE_QUEUE = "decode_waiting"  # waiting queue → first forward
SPAN_SGLANG_DECODE_FIRST_TOKEN = "fake_output"  # first forward → the prefill's token handed out (prebuilt batch)
# TGI's request span (text-generation-inference router/src/server.rs, v3.3.x): named after the handler,
# INTERNAL (tracing-opentelemetry's default kind), durations recorded as `format!("{:?}", Duration)`
TGI_REQUEST_SPANS = ("generate", "generate_stream", "completions", "chat_completions")
TGI_VALIDATION_TIME = "validation_time"  # handler start → queued (validation, tokenisation)
TGI_QUEUE_TIME = "queue_time"  # queued → its batch formed
TGI_INFERENCE_TIME = "inference_time"  # batch formed → last token in the router: prefill + every decode step
TGI_TOTAL_TIME = "total_time"  # handler start → last token in the router
TGI_TIME_PER_TOKEN = "time_per_token"  # inference_time / generated tokens (prefill included)

# --- phaselens keys -------------------------------------------------------------------------
# Server view (durations in ms, one clock)
PL_INGRESS_MS = "phaselens.ingress_ms"
PL_QUEUE_MS = "phaselens.queue_ms"
PL_PREFILL_MS = "phaselens.prefill_ms"
PL_FIRST_TOKEN_MS = "phaselens.first_token_ms"
PL_FIRST_CHUNK_MS = "phaselens.first_chunk_ms"  # = loop_wait + encode
PL_HELD_BACK_MS = "phaselens.held_back_ms"  # first token → the token that made the first content visible
PL_HELD_BACK_TOKENS = "phaselens.held_back.tokens"  # the tokens before it (byte-level tokens with no text yet)
PL_FIRST_CHUNK_LOOP_WAIT_MS = "phaselens.first_chunk.loop_wait_ms"  # handed to the stream → the event loop took it
PL_FIRST_CHUNK_ENCODE_MS = "phaselens.first_chunk.encode_ms"  # taken → its body chunk handed to send (SSE encoding)
PL_FIRST_CHUNK_WRITE_MS = "phaselens.first_chunk.write_ms"  # send called → returned: outside the term, beside it
# the first body chunks handed to `send` from the first content chunk on (at most FIRST_SENDS_MAX):
# each one's stamp − the first's (ns), and the body bytes sent through it; what the view needs to
# estimate a late client's wait that TCP hid by coalescing (docs/budget-method.md#the-terms)
PL_FIRST_SENDS_NS = "phaselens.first_chunk.sends_ns"
PL_FIRST_SENDS_BODY_BYTES = "phaselens.first_chunk.sends_body_bytes"
FIRST_SENDS_MAX = 32
PL_INBOUND_MS = "phaselens.inbound_ms"  # request bytes in the server's kernel → ingress (= kernel_wait + dispatch)
PL_INBOUND_KERNEL_WAIT_MS = "phaselens.inbound.kernel_wait_ms"  # kernel receive stamp → the event loop read them
PL_INBOUND_DISPATCH_MS = "phaselens.inbound.dispatch_ms"  # read → the ASGI app called (HTTP parsing, task start)
PL_DECODE_MS = "phaselens.decode_ms"
PL_DELIVERY_MS = "phaselens.delivery_ms"
PL_SERVER_TTFT_MS = "phaselens.server.ttft_ms"
PL_SERVER_TTFC_MS = "phaselens.server.ttfc_ms"  # received → first content chunk handed to the server's send
PL_SERVER_LAST_CHUNK_MS = "phaselens.server.last_chunk_ms"  # received → last content chunk handed to it
PL_SERVER_TPOT_MS = "phaselens.server.tpot_ms"
PL_PREFILL_CHUNKS = "phaselens.prefill.chunks"
PL_CHUNK_INDEX = "phaselens.prefill.chunk_index"
PL_CHUNK_TOKENS = "phaselens.prefill.chunk_tokens"
PL_CACHED_TOKENS = "phaselens.prefill.cached_tokens"
PL_PREFILL_RECOMPUTE = "phaselens.prefill.recompute"  # chunk re-run after a preemption, inside decode
PL_QUEUE_WAIT_INDEX = "phaselens.queue.wait_index"  # 0 first wait, >0 after a preemption
PL_PREEMPTIONS = "phaselens.preemptions"
PL_DECODE_TOKENS = "phaselens.decode.tokens"
PL_DECODE_STEPS = "phaselens.decode.steps"
PL_ITL_P50_MS = "phaselens.decode.itl_p50_ms"
PL_ITL_P99_MS = "phaselens.decode.itl_p99_ms"
PL_ITL_MAX_MS = "phaselens.decode.itl_max_ms"
PL_STALL_MS = "phaselens.decode.stall_ms"
PL_TOKEN_COUNT = "phaselens.token.count"  # on a per-token event: tokens that step gave
PL_FINISH_REASON = "phaselens.finish_reason"
# Which requests kept their full phase tree, and why (on every SERVER root and CLIENT span): the
# head sampler's decision, the tail rule (a failure, a TTFT or TPOT over the threshold), or none (the
# span is the request's compact record alone)
PL_TRACE_FULL = "phaselens.trace.full"
TRACE_FULL_HEAD, TRACE_FULL_TAIL_ERROR, TRACE_FULL_TAIL_SLO, TRACE_FULL_NONE = "head", "tail_error", "tail_slo", "none"
PL_CLIENT_DISCONNECTED = "phaselens.client_disconnected"
# wall/mono anchor of the emitting process, for the clock-offset diagnostic only
PL_RECEIVED_WALL_NS = "phaselens.server.received_wall_ns"
PL_RESPONDED_WALL_NS = "phaselens.server.responded_wall_ns"

# Disaggregated serving: resource attributes of each instance, and the P/D terms (ms, the emitter's clock)
PL_PD_ROLE = "phaselens.pd.role"  # resource: router | prefill | decode
PL_PD_INSTANCE = "phaselens.pd.instance"  # resource: the instance's URL as the router knows it
PL_PD_TRANSFER_ID = "phaselens.pd.transfer_id"
# what a P/D router speaks to its instances (`serve --role router --pd-protocol`): phaselens's, or vLLM's
PD_PROTOCOL_PHASELENS, PD_PROTOCOL_VLLM = "phaselens", "vllm"
PL_KV_BYTES = "phaselens.kv.bytes"  # llm.kv_transfer: bytes sent; llm.kv_receive: bytes received
PL_KV_ACKED_BYTES = "phaselens.kv.acked_bytes"  # llm.kv_transfer: bytes the receiver's ack reports
PL_KV_TRANSFER_MS = "phaselens.kv.transfer_ms"  # send start → acknowledgement (prefill clock)
PL_KV_WAIT_MS = "phaselens.kv.wait_ms"  # first token → send start (prefill clock)
PL_KV_READ_MS = "phaselens.kv.read_ms"  # llm.kv_receive: accepted → bytes read (decode clock)
PL_KV_STAGE_MS = "phaselens.kv.stage_ms"  # llm.kv_receive: bytes read → written into the pool (decode clock)
PL_KV_SAVE_MS = "phaselens.kv.save_ms"  # llm.kv_save: time inside the connector's save calls (prefill clock)
PL_KV_LOAD_MS = "phaselens.kv.load_ms"  # llm.kv_load: time inside the connector's load calls (decode clock)
PL_KV_PEER = "phaselens.kv.peer"  # the other instance's KV address
PL_PD_PREFILL_ANSWER_MS = "phaselens.pd.prefill_answer_ms"  # llm.kv_transfer: received → answer built (prefill clock)
PL_ROUTER_INGRESS_MS = "phaselens.router.ingress_ms"  # received → request sent to the prefill instance
PL_ROUTER_PREFILL_CALL_MS = "phaselens.router.prefill_call_ms"  # that request → its answer
PL_ROUTER_GAP_MS = "phaselens.router.gap_ms"  # the prefill answer → request sent to the decode instance
PL_ROUTER_DECODE_FIRST_CHUNK_MS = "phaselens.router.decode_first_chunk_ms"  # that request → first content chunk back
PL_ROUTER_RELAY_MS = "phaselens.router.relay_ms"  # that chunk → handed to the router's send
PL_ROUTER_PREFILL = "phaselens.router.prefill"  # the prefill instance's URL
PL_ROUTER_DECODE = "phaselens.router.decode"  # the decode instance's URL

# Engine step
PL_STEP_INDEX = "phaselens.step.index"
PL_STEP_NUM_SEQS = "phaselens.step.num_seqs"
PL_STEP_PREFILL_TOKENS = "phaselens.step.prefill_tokens"
PL_STEP_DECODE_TOKENS = "phaselens.step.decode_tokens"
PL_STEP_KV_BLOCKS_USED = "phaselens.step.kv_blocks_used"
PL_STEP_KV_BLOCKS_TOTAL = "phaselens.step.kv_blocks_total"
PL_STEP_PREEMPTIONS = "phaselens.step.preemptions"
PL_STEP_QUEUE_DEPTH = "phaselens.step.queue_depth"
PL_STEP_DURATION_MS = "phaselens.step.duration_ms"

# Client view (durations in ms, client monotonic clock)
PL_CLIENT_TTFT_MS = "phaselens.client.ttft_ms"
PL_CLIENT_TTFO_MS = "phaselens.client.ttfo_ms"
PL_CLIENT_TPOT_MS = "phaselens.client.tpot_ms"
PL_CLIENT_READ_MS = "phaselens.client.read_ms"  # first content bytes in the client's kernel → the client read them
PL_CLIENT_END_READ_MS = "phaselens.client.end_read_ms"  # the same for the last content bytes
# the read holding the first content chunk: later events came with it (TCP stamped it with their
# packet), and the response body bytes received through that read's newest byte
PL_CLIENT_READ_COALESCED = "phaselens.client.read_coalesced"
PL_CLIENT_READ_BODY_BYTES = "phaselens.client.read_body_bytes"
PL_CLIENT_SEND_MS = "phaselens.client.send_ms"  # request started → its bytes handed to the kernel, less the connect
PL_CLIENT_E2E_MS = "phaselens.client.e2e_ms"
PL_CLIENT_ITL_P50_MS = "phaselens.client.itl_p50_ms"
PL_CLIENT_ITL_P99_MS = "phaselens.client.itl_p99_ms"
PL_CLIENT_ITL_MAX_MS = "phaselens.client.itl_max_ms"
PL_CLIENT_ITL_TOKEN_P50_MS = "phaselens.client.itl_per_token_p50_ms"
PL_CLIENT_ITL_TOKEN_P99_MS = "phaselens.client.itl_per_token_p99_ms"
PL_CLIENT_CHUNKS = "phaselens.client.chunks"
PL_CLIENT_COUNTED_TOKENS = "phaselens.client.counted_tokens"
PL_CLIENT_USAGE_MISMATCH = "phaselens.client.usage_mismatch"
PL_CLIENT_INTENDED_DELAY_MS = "phaselens.client.schedule_lag_ms"
PL_CLIENT_OUTCOME = "phaselens.client.outcome"  # OUTCOME_NO_OUTPUT, else absent (ok, or error.type)
OUTCOME_NO_OUTPUT = "no_output"  # completed without a content chunk (e.g. EOS first): no TTFT, not an error
PL_CLIENT_SENT_WALL_NS = "phaselens.client.sent_wall_ns"
PL_CLIENT_DONE_WALL_NS = "phaselens.client.done_wall_ns"
# Who measured the client view: a client span imported from another harness's export (`phaselens import`)
PL_CLIENT_HARNESS = "phaselens.client.harness"  # e.g. aiperf; absent on phaselens's own client spans
PL_CLIENT_HARNESS_VERSION = "phaselens.client.harness_version"
PL_CLIENT_INPUT_TOKENS = "phaselens.client.input_tokens"  # as the harness counted them (its tokenizer or usage)
PL_CLIENT_OUTPUT_TOKENS = "phaselens.client.output_tokens"
HARNESS_PHASELENS = "phaselens"  # view column `client_harness` for a client span without the key

# --- metrics (GenAI semconv, seconds) -------------------------------------------------------
METRIC_SERVER_TTFT = "gen_ai.server.time_to_first_token"
METRIC_SERVER_TPOT = "gen_ai.server.time_per_output_token"
METRIC_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
METRIC_CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
METRIC_TELEMETRY_DROPPED = "phaselens.telemetry.dropped"  # counter: records/spans phaselens lost
PL_TELEMETRY_DROP_REASON = "phaselens.telemetry.reason"  # its attribute: what was lost where

BUCKETS_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
BUCKETS_TPOT_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
BUCKETS_DURATION_S = tuple(0.01 * 2**i for i in range(14))  # 0.01 … 81.92, doubling

# --- environment switches -------------------------------------------------------------------
ENV_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENV_TOKEN_EVENTS = "PHASELENS_TOKEN_EVENTS"
ENV_SPAN_BUILDER = "PHASELENS_SPAN_BUILDER"  # thread | process: where ServerTelemetry.from_env builds spans
ENV_SPAN_BACKEND = "PHASELENS_SPAN_BACKEND"  # fast | sdk: how the span-builder process makes OTLP (default fast)
SPAN_BACKEND_FAST, SPAN_BACKEND_SDK = "fast", "sdk"
ENV_TAIL_SLO = "PHASELENS_TAIL_SLO"  # ttft:MS,tpot:MS over which a request keeps its tree; off: no tail rule
ENV_TRACES_SAMPLER, ENV_TRACES_SAMPLER_ARG = "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"
# Dynamo's worker span (ai-dynamo/dynamo lib/backend-common/src/adapter.rs at 052692a7, EngineAdapter):
# one `engine.generate` per request per worker, child of the runtime's `handle_payload`; its fields
# become string attributes, the durations in ms on that worker's clock (Instant)
SPAN_DYNAMO_ENGINE_GENERATE = "engine.generate"
DYNAMO_DISAGG_ROLE = "disagg_role"  # agg | prefill | decode | encode (DisaggregationMode::as_str)
DYNAMO_PD_ROLES = ("prefill", "decode")
DYNAMO_TTFT_MS = "ttft_ms"  # the engine's stream set up → first non-empty chunk
DYNAMO_ITL_P99_MS = "itl_p99_ms"  # nearest-rank p99 of the gaps between non-empty chunks
# What Dynamo 1.6.1 emits (its Rust runtime's tracing spans, read live: docs/other-servers.md#dynamo).
# The frontend's `http-request` (lib/runtime/src/logging.rs): the request on the frontend's clock,
# its `ttft_ms` the frontend's TTFT (ms as a string); `router.route_request`
# (lib/runtime/src/pipeline/network/egress/push_router.rs): the frontend's call to one worker, until
# that worker's stream ended; on the worker, the runtime's `handle_payload` (logging.rs): received →
# its stream ended, on the worker's clock. Every span carries tracing-opentelemetry's `busy_ns`
# (the span's task being polled) and `idle_ns` (the task waiting).
SPAN_DYNAMO_HTTP_REQUEST = "http-request"
SPAN_DYNAMO_ROUTE = "router.route_request"
SPAN_DYNAMO_HANDLE = "handle_payload"
DYNAMO_TARGET = "target"  # the tracing target: `request_span` on the request spans of Dynamo's runtime
DYNAMO_REQUEST_SPAN_TARGET = "request_span"
DYNAMO_COMPONENT = "component"  # handle_payload: `prefill` on a prefill worker, `backend` on the others
DYNAMO_PREFILL_COMPONENT = "prefill"
# on the frontend's call to a decode (or aggregated) worker only: its prefill call carries no migration
DYNAMO_MIGRATION_TOKENS = "migration.tokens_completed"
DYNAMO_BUSY_NS = "busy_ns"
DYNAMO_IDLE_NS = "idle_ns"
