"""What the delivery middleware (`delivery.py`) and the hooks (`hooks.py`) share: the HTTP request
vLLM is running, and the import path that installs the middleware."""

from __future__ import annotations

from contextvars import ContextVar

from phaselens.instrumentation.hotpath import ServerRequest

# the import path for vLLM's --middleware: importing that module also wraps uvicorn's HTTP protocol
MIDDLEWARE_PATH = "phaselens.integrations.vllm.middleware.FirstChunkMiddleware"
# the HTTP request's handle while vLLM runs it, in its task (and the tasks that task starts)
HTTP_REQUEST: ContextVar[ServerRequest | None] = ContextVar("phaselens_vllm_http_request", default=None)
