"""Records → spans and metrics, off the loop: OTel setup from `OTEL_*` (and the sampling variables'
check), the counters, and spans
made after the fact from monotonic stamps (`StampedSpans`)."""

from phaselens.instrumentation.pipeline.counters import Counters
from phaselens.instrumentation.pipeline.otel_setup import configure, export_counters, tag_pd_resource
from phaselens.instrumentation.pipeline.sampling import check_sampling_env, compact_env_sampler
from phaselens.instrumentation.pipeline.stamped_spans import StampedSpans, parse_traceparent, traceparent

__all__ = [
    "Counters",
    "StampedSpans",
    "check_sampling_env",
    "compact_env_sampler",
    "configure",
    "export_counters",
    "parse_traceparent",
    "tag_pd_resource",
    "traceparent",
]
