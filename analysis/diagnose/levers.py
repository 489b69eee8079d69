"""The levers that act on each cause (the optimisation map), each with the measured evidence that it
would help. A lever is only offered with its evidence line: a figure of this selection, with its
percentile and sample size where it has them; a cause whose evidence is missing gets no lever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phaselens.analysis import thresholds as th
from phaselens.analysis.diagnose.diagnose_figures import Figures, LoadDependence, num, pct


@dataclass(slots=True)
class Lever:
    cause: str
    action: str
    evidence: str

    def __post_init__(self) -> None:
        if not self.evidence:
            raise ValueError(f"a lever without evidence ({self.cause}: {self.action})")


def _term(f: Figures, name: str, label: str) -> str | None:
    """`label p99 = X ms = S of TTFT p99 (n = N)`, None when the term was not measured."""
    value = f.at(name, 1)
    if value is None:
        return None
    return f"{label} p99 = {num(value)} = {pct(f.share(name, 'ttft_ms', 1))} of TTFT p99 (n = {f.requests})"


def _queue(f: Figures, load: LoadDependence) -> list[Lever]:
    out = []
    if load.grows:
        out.append(
            Lever(
                "queue", "add capacity (replicas) or admit less: queueing grows with the arrival rate", load.evidence[0]
            )
        )
    elif load.single_rate and (line := _term(f, "queue_ms", "queue")):
        run = f"; confirm with a second, slower run: {load.next_run}" if load.next_run else ""
        out.append(Lever("queue", "add capacity (replicas) if queueing grows with the arrival rate", line + run))
    batch, depth = f.engine.get("batch_size_mean"), f.engine.get("queue_depth_max")
    if batch is not None and depth:
        out.append(
            Lever(
                "queue",
                "raise --max-num-seqs / the batch size if the engine has compute headroom",
                f"mean batch {batch:.1f} sequences while up to {int(depth)} requests waited",
            )
        )
    return out


def _prefill(f: Figures, load: LoadDependence) -> list[Lever]:
    inp, hit = f.at("input_tokens", 0), f.prefix_hit_rate
    if inp is None or hit is None:
        return []
    reuse = (
        "share a common prompt prefix (system prompt, few-shot examples) so the prefix cache serves it"
        if hit < th.PREFIX_HIT_LOW
        else "keep the prefix cache large enough for the repeated prefixes"
    )
    prefill = f.at("prefill_ms", 0)
    per_1k = f" ({prefill / inp * 1000:.0f} ms per 1k prompt tokens)" if prefill and inp else ""
    return [
        Lever(
            "prefill",
            reuse,
            f"prefix-cache hit rate {pct(hit)} of {f.requests} requests' input tokens; prompt p50 {inp:.0f} tokens",
        ),
        Lever(
            "prefill",
            "shorter prompts or more prefill compute (a faster GPU, tensor parallelism)",
            f"prefill p50 = {num(prefill)} for a p50 prompt of {inp:.0f} tokens{per_1k}",
        ),
    ]


def _stalls(f: Figures, load: LoadDependence) -> list[Lever]:
    e = f.engine
    mixed = e.get("mixed_steps")
    if not mixed:
        return []
    steps = (
        f"{int(mixed)} of {int(e.get('decode_steps') or 0)} decode steps carried prefill; mixed step "
        f"p50 {num(e.get('mixed_step_p50_ms'))} vs decode-only {num(e.get('decode_step_p50_ms'))}; "
        f"{pct(e.get('stall_share'))} of decode-token time lost"
    )
    rate = f" at {load.rate_high_rps:.2f} req/s" if load.rate_high_rps else ""
    return [
        Lever(
            "prefill_stalls",
            "lower the chunked-prefill token budget (--max-num-batched-tokens) so a mixed step carries less prefill",
            steps,
        ),
        Lever(
            "prefill_stalls",
            "disaggregate prefill and decode (separate prefill and decode instances)",
            f"prompt p50 {f.at('input_tokens', 0) or 0:.0f} tokens{rate} stall a mean batch of "
            f"{e.get('batch_size_mean') or 0:.1f} decoding sequences",
        ),
    ]


def _kv(f: Figures, load: LoadDependence) -> list[Lever]:
    e = f.engine
    if e.get("kv_used_p90") is None:
        return []
    evidence = (
        f"KV blocks in use p90 {pct(e['kv_used_p90'])}, max {pct(e.get('kv_used_max'))} of the cache; "
        f"{int(e.get('preemptions') or 0)} preemptions, {pct(f.preempted_share)} of requests preempted"
    )
    return [
        Lever("kv_pressure", "more KV capacity (--kv-cache-tokens, GPU memory, a quantised KV cache)", evidence),
        Lever(
            "kv_pressure",
            "a smaller batch (--max-num-seqs) so the running sequences fit",
            f"mean batch {e.get('batch_size_mean') or 0:.1f} sequences; " + evidence,
        ),
    ]


def _decode(f: Figures, load: LoadDependence) -> list[Lever]:
    tpot, batch = f.at("server_tpot_ms", 0), f.engine.get("batch_size_mean")
    if tpot is None:
        return []
    batch_text = f" with a mean batch of {batch:.1f} sequences" if batch is not None else ""
    return [
        Lever(
            "decode",
            "faster decode steps (smaller batch, quantised weights, speculative decoding)",
            f"server TPOT p50 = {num(tpot)}, p99 = {num(f.at('server_tpot_ms', 1))}{batch_text}",
        )
    ]


def _term_lever(cause: str, column: str, label: str, action: str) -> Callable[[Figures, LoadDependence], list[Lever]]:
    def levers(f: Figures, load: LoadDependence) -> list[Lever]:
        line = _term(f, column, label)
        return [Lever(cause, action, line)] if line else []

    return levers


def _client(f: Figures, load: LoadDependence) -> list[Lever]:
    client, server = f.at("client_tpot_ms", 0), f.at("server_tpot_ms", 0)
    evidence = []
    if client is not None and server is not None:
        evidence.append(f"client TPOT p50 = {num(client)} vs server TPOT p50 = {num(server)}")
    own, ttft = f.at("client_ms", 1), f.at("ttft_ms", 1)
    if own and ttft:
        evidence.append(
            f"the client's own time (send + read of the first chunk, with the estimated wait TCP's coalescing hid) "
            f"p99 = {num(own)} = {100 * own / ttft:.0f} % of TTFT p99"
        )
    if not evidence:
        return []
    return [
        Lever(
            "client",
            "read the stream faster (fewer streams per client process, more client processes, less work per chunk)",
            f"{'; '.join(evidence)} (n = {f.with_client})",
        )
    ]


LEVERS: dict[str, Callable[[Figures, LoadDependence], list[Lever]]] = {
    "queue": _queue,
    "prefill": _prefill,
    "prefill_stalls": _stalls,
    "kv_pressure": _kv,
    "decode": _decode,
    "delivery": _term_lever(
        "delivery",
        "delivery_ms",
        "first chunk (server delivery)",
        "unblock the server's event loop (more API server processes, less work per chunk)",
    ),
    "network": _term_lever(
        "network",
        "network_ms",
        "residual (network: what no stamp explains)",
        "move the client closer, reuse connections (keep-alive), check the client's own load",
    ),
    "ingress": _term_lever(
        "ingress",
        "ingress_ms",
        "ingress",
        "faster request handling: tokenisation and validation off the event loop, more API processes",
    ),
    "client": _client,
}


def levers(causes: list[str], f: Figures, load: LoadDependence) -> list[Lever]:
    """Every lever of every cause, in the causes' order."""
    return [lever for cause in causes if cause in LEVERS for lever in LEVERS[cause](f, load)]
