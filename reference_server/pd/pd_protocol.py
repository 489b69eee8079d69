"""What the router (reference_server.router) sends the instances of a disaggregated request, per
protocol (`phaselens serve --role router --pd-protocol NAME`; docs/disaggregation.md):

    phaselens   the reference server's instances: the prefill half names the decode instance's KV
                port and a transfer id, `finish_reason` "transferred" when the KV went over; the
                decode half claims the KV by that id
    vllm        vLLM's instances with a KV connector (vLLM's own proxies' two steps): the prefill
                half with `max_tokens` 1 and `kv_transfer_params.do_remote_decode`, the decode half
                with the `kv_transfer_params` of the prefill's answer (the connector's handle on
                the KV: block ids, engine id, host, port; None for a connector that finds the KV by
                the prompt, as ExampleConnector)

The body is otherwise the client's; the prefill half is never streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phaselens.instrumentation import names
from phaselens.reference_server.engine.sequence import FINISH_TRANSFERRED  # torch-free: the CLI imports this

PROTOCOL_PHASELENS, PROTOCOL_VLLM = names.PD_PROTOCOL_PHASELENS, names.PD_PROTOCOL_VLLM
PROTOCOLS = (PROTOCOL_PHASELENS, PROTOCOL_VLLM)
# vLLM's remote-decode request (vllm/distributed/kv_transfer/kv_connector/v1/nixl/, toy_proxy_server.py)
VLLM_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _prefill_base(body: dict[str, Any], dropped: tuple[str, ...] = ("stream_options",)) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in dropped} | {"stream": False}


@dataclass(frozen=True, slots=True)
class PdProtocol:
    name: str

    @property
    def needs_kv_address(self) -> bool:
        """The prefill half names the decode instance's KV port (learnt from its /health)."""
        return self.name == PROTOCOL_PHASELENS

    def prefill_half(self, body: dict[str, Any], transfer_id: str, kv_address: str) -> dict[str, Any]:
        if self.name == PROTOCOL_VLLM:
            one = {"max_completion_tokens": 1} if "max_completion_tokens" in body else {}
            # min_tokens above 1 would make vLLM refuse max_tokens 1 (400); the decode half keeps it
            half = _prefill_base(body, ("stream_options", "min_tokens"))
            return half | {"max_tokens": 1, **one, "kv_transfer_params": dict(VLLM_REMOTE_DECODE)}
        return _prefill_base(body) | {"kv_transfer_params": {"decode_kv": kv_address, "transfer_id": transfer_id}}

    def whole(self, answer: dict[str, Any]) -> bool:
        """The prefill's answer is the whole answer (the first token ended the request): the
        reference instance did not transfer; a vLLM prefill half always goes on to decode."""
        if self.name == PROTOCOL_VLLM:
            return False
        return answer["choices"][0].get("finish_reason") != FINISH_TRANSFERRED

    def decode_half(self, body: dict[str, Any], transfer_id: str, answer: dict[str, Any]) -> dict[str, Any]:
        if self.name == PROTOCOL_VLLM:
            params = answer.get("kv_transfer_params")
            return body | {"kv_transfer_params": params} if params else dict(body)
        return body | {"kv_transfer_params": {"transfer_id": transfer_id}}


def protocol(name: str) -> PdProtocol:
    if name not in PROTOCOLS:
        raise ValueError(f"--pd-protocol must be one of {', '.join(PROTOCOLS)}, got {name!r}")
    return PdProtocol(name)
