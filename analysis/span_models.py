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
    n.SPAN_MODEL_ENGINE_KEYS: (
        "de-facto gen_ai.latency.* keys only: ingress and first_token are not separated "
        "(before_engine_ms = server TTFT − queue − prefill); the first chunk's delivery is inside residual_ms"
    ),
}


def notes(span_models: list[str]) -> list[str]:
    """One line per span model in the selection that cannot separate every term."""
    return [f"{model}: {UNSEPARATED[model]}" for model in sorted(span_models) if model in UNSEPARATED]
