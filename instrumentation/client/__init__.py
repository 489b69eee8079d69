"""The client side: the traced streaming client and the end-of-stream sentinel of its SSE parser."""

from phaselens.instrumentation.client.sse import DONE
from phaselens.instrumentation.client.traced_client import StreamResult, TracedClient

__all__ = ["DONE", "StreamResult", "TracedClient"]
