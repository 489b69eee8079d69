"""The serving process's glue: `ServerTelemetry`, the ASGI ingress middleware and its types, the
inbound protocol that reads the kernel's receive stamps."""

from phaselens.instrumentation.server.asgi import IngressMiddleware, Message, Receive, Scope, Send
from phaselens.instrumentation.server.inbound import InboundProtocol, inbound_protocol
from phaselens.instrumentation.server.telemetry import SCOPE_KEY, ServerTelemetry

__all__ = [
    "SCOPE_KEY",
    "InboundProtocol",
    "IngressMiddleware",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "ServerTelemetry",
    "inbound_protocol",
]
