"""phaselens instrumentation: the plugin a serving loop or a client imports.

The public API, in one place (docs/contracts.md):

    from phaselens.instrumentation import ServerTelemetry, RequestInfo, StepStats

Rooms, by concern:
- `hotpath/`   what the serving loop touches: integer stamps, the observer interface, ids, records
- `pipeline/`  records → spans and metrics off the loop: sinks, the span builder, OTel setup, counters
- `process/`   the span builder in a child process: the sink that ships records, the wire, retention
- `server/`    the serving process's glue: `ServerTelemetry` and the ASGI ingress middleware
- `client/`    the traced streaming client, its HTTP transport and SSE parser
- `names.py`   span, attribute and metric names: the data contract
"""

from phaselens.instrumentation.client.traced_client import StreamResult, TracedClient
from phaselens.instrumentation.hotpath.observer import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    NULL_REQUEST,
    NULL_STEP,
    RequestHandle,
    RequestObserver,
    StepObserver,
)
from phaselens.instrumentation.hotpath.records import RequestInfo, StepStats
from phaselens.instrumentation.server.telemetry import ServerTelemetry

__all__ = [
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "NULL_REQUEST",
    "NULL_STEP",
    "RequestHandle",
    "RequestInfo",
    "RequestObserver",
    "ServerTelemetry",
    "StepObserver",
    "StepStats",
    "StreamResult",
    "TracedClient",
]
