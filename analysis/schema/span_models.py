"""What each span model can and cannot separate (docs/budget-method.md#servers-with-coarser-spans).

A request row says which producer's spans it was built from (`span_model` in the per-request view);
the budget, the report and the dashboards print these notes for every span model in the selection
other than the full phaselens tree.
"""

from __future__ import annotations

from phaselens.instrumentation import names as n

UNSEPARATED: dict[str, str] = {
    n.SPAN_MODEL_VLLM: (
        "vLLM's native llm_request span: ingress and first_token are not separated; before_engine_ms = "
        "server TTFT − queue − prefill holds tokenisation, the hop into the EngineCore and the first "
        "token's hop back to the API server; the first chunk's delivery (vLLM's output handler → "
        "bytes written), its held-back decode steps and the inbound edge are inside residual_ms (the "
        "phaselens plugin with its --middleware names them); no delivery_ms, no engine steps"
    ),
    n.SPAN_MODEL_SGLANG: (
        "SGLang's native request trace: first_token is not separated; before_engine_ms = server TTFT − "
        "ingress − queue − prefill holds the hop to the scheduler, its request_process and the first "
        "token's way back to the TokenizerManager; the first chunk's delivery is inside residual_ms; "
        "no delivery_ms, no engine steps"
    ),
    n.SPAN_MODEL_TGI: (
        "TGI's native request span gives no TTFT: only ingress (validation_time) and queue (queue_time) "
        "of the TTFT terms; prefill, first token and every decode step are one inference_time, so "
        "server TTFT, prefill_ms, first_token_ms, decode_ms and residual_ms stay empty; e2e_residual_ms = "
        "client e2e − total_time (network, client, the last event's encoding)"
    ),
    n.SPAN_MODEL_DYNAMO: (
        "Dynamo's frontend http-request: its ttft_ms is server TTFT, whole (no ingress, queue, prefill or "
        "first token apart: before_engine_ms is all of it); its parts through a prefill worker are in the "
        "Dynamo budget (frontend_dispatch_ms, prefill_call_ms, kv_transfer_est_ms); no first chunk, "
        "delivery_ms, ITL or engine steps"
    ),
    n.SPAN_MODEL_ENGINE_KEYS: (
        "de-facto gen_ai.latency.* keys only: ingress and first_token are not separated "
        "(before_engine_ms = server TTFT − queue − prefill); the first chunk's delivery is inside residual_ms"
    ),
}


def notes(span_models: list[str]) -> list[str]:
    """One line per span model in the selection that cannot separate every term."""
    return [f"{model}: {UNSEPARATED[model]}" for model in sorted(span_models) if model in UNSEPARATED]


# What a P/D span model's rows cannot show in the P/D columns (docs/disaggregation.md#servers-we-do-not-own)
PD_UNSEPARATED: dict[str, str] = {
    n.SPAN_MODEL_SGLANG: (
        "SGLang's router sends each request to both instances at once, so the P/D terms run in parallel "
        "and do not add up to client TTFT (no request is complete); decode_kv_wait_ms (decode clock) holds "
        "the prefill instance's queue, prefill and transfer; kv_transfer_ms also holds the sender's queue "
        "(no kv_wait_ms); no KV bytes, router terms, hops or first chunk on SGLang's spans"
    ),
    n.SPAN_MODEL_VLLM: (
        "vLLM's llm_request on instances tagged with their role: only the prefill instance's queue and "
        "prefill and the decode instance's first step; the decode side's queue holds the KV pull and the "
        "wait for a seat (not separable, left NULL); no KV transfer, bytes, router terms or hops"
    ),
    n.SPAN_MODEL_DYNAMO: (
        "Dynamo's engine.generate per worker (where a version emits it): only each worker's engine TTFT "
        "(prefill_engine_ttft_ms: queue, prefill and first token; decode_engine_ttft_ms: KV pull, queue and "
        "first step; neither separable) and the decode worker's ITL p99; Dynamo 1.6.1's handle_payload and "
        "router.route_request: the frontend's dispatch and prefill call, the KV-transfer estimate and each "
        "worker's busy/idle time (the Dynamo budget); no KV bytes, no hops (handle_payload outlasts the "
        "frontend's call), no phaselens P/D terms"
    ),
}


def pd_notes(span_models: list[str]) -> list[str]:
    """One line per P/D span model in the selection that cannot fill every P/D term."""
    return [f"{model}: {PD_UNSEPARATED[model]}" for model in sorted(span_models) if model in PD_UNSEPARATED]
