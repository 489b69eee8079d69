"""What vLLM's `--middleware` names (docs/vllm.md#the-first-chunk):

    vllm serve MODEL --otlp-traces-endpoint URL \\
        --middleware phaselens.integrations.vllm.middleware.FirstChunkMiddleware

vLLM imports this module in its API server while it builds the app, before uvicorn loads its
configuration; importing it makes uvicorn's HTTP protocol `delivery.VllmInboundProtocol` there (the
inbound edge), and the middleware is `delivery.FirstChunkMiddleware` (the first chunk). Nothing else
imports this module, so no other process's uvicorn changes.
"""

from __future__ import annotations

from .delivery import FirstChunkMiddleware, use_inbound_protocol

__all__ = ["FirstChunkMiddleware"]

use_inbound_protocol()
