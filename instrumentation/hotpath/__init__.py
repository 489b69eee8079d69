"""What a serving loop touches, for code outside instrumentation that needs more than
`phaselens.instrumentation` exports: the per-request handle and timeline, span ids, the kernel's
receive stamps."""

from phaselens.instrumentation.hotpath.handle import ServerRequest
from phaselens.instrumentation.hotpath.ids import span_context
from phaselens.instrumentation.hotpath.kernel_stamps import enable_kernel_stamps
from phaselens.instrumentation.hotpath.records import SpanIds
from phaselens.instrumentation.hotpath.timeline import RequestTimeline

__all__ = ["RequestTimeline", "ServerRequest", "SpanIds", "enable_kernel_stamps", "span_context"]
