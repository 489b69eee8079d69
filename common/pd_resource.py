"""The resource tags of a disaggregated-serving process (docs/disaggregation.md#spans-across-hops):
its role and its URL, appended to OTEL_RESOURCE_ATTRIBUTES, which every OTel SDK process reads
(the span-builder child too, which inherits the environment)."""

from __future__ import annotations

from phaselens.instrumentation import names

RESOURCE_ENV = "OTEL_RESOURCE_ATTRIBUTES"


def with_pd_tags(given: str, role: str, url: str) -> str:
    """`given` (OTEL_RESOURCE_ATTRIBUTES' value, maybe empty) with `phaselens.pd.role` and
    `phaselens.pd.instance` appended."""
    ours = f"{names.PL_PD_ROLE}={role},{names.PL_PD_INSTANCE}={url}"
    return f"{given},{ours}" if given else ours
