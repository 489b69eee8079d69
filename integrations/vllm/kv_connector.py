"""A vLLM KV connector that times another one per request (docs/vllm.md#disaggregated-prefill-and-decode).

    --kv-transfer-config '{"kv_connector": "PhaselensExampleConnector",
                           "kv_connector_module_path": "phaselens.integrations.vllm.kv_connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

`Phaselens<Name>` is vLLM's registered connector `<Name>` (ExampleConnector, NixlConnector, …)
subclassed with the timing of `kv_timing.py`: this module makes the class when vLLM's factory
looks the name up (`__getattr__`), so every method, class method and setting stays the delegate's.
vLLM loads the class in its EngineCore (scheduler side: which requests save and load) and its
workers (the calls timed); the records ride the connector's stats to the API server, where the
plugin's tracker (`tracker.py`) hands them to the requests. Imported only inside vLLM's processes.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .kv_timing import INNER, KV_RECORDS, StepTiming, example_connector_bytes, merged, step_requests

PREFIX = "Phaselens"
STATS = "Stats"
META_KEY = "phaselens_kv"  # the attribute of the connector metadata that names the step's (saves, loads)


class PhaselensKvStats(KVConnectorStats):
    """The records (`kv_timing`) and the delegate's own payload, aggregated across workers and steps."""

    data: dict[str, Any]
    inner_cls: Any = None  # the delegate connector's class, which builds its stats

    def _inner(self) -> KVConnectorStats | None:
        payload = self.data.get(INNER)
        return None if payload is None or self.inner_cls is None else self.inner_cls.build_kv_connector_stats(payload)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine, theirs = self._inner(), other._inner() if isinstance(other, PhaselensKvStats) else None
        inner = mine.aggregate(theirs) if mine is not None and theirs is not None else (mine or theirs)
        records = [*self.data.get(KV_RECORDS, ()), *other.data.get(KV_RECORDS, ())]
        self.data = merged(records, inner.data if inner is not None else None)
        return self

    def reset(self) -> None:
        self.data = merged([], None)

    def reduce(self) -> dict[str, int | float]:
        inner = self._inner()
        return {**(inner.reduce() if inner is not None else {}), "phaselens KV records": len(self.data[KV_RECORDS])}

    def is_empty(self) -> bool:
        inner = self._inner()
        return not self.data.get(KV_RECORDS) and (inner is None or inner.is_empty())


def _timed(inner_cls: type) -> tuple[type, type[PhaselensKvStats]]:
    """`inner_cls` with its KV moves timed per request, and its stats class."""
    name = f"{PREFIX}{inner_cls.__name__}"
    # named as this module's attributes (`__getattr__`), so that pickle finds both in another process
    stats_cls = type(f"{name}{STATS}", (PhaselensKvStats,), {"inner_cls": inner_cls, "__module__": __name__})

    class Timed(inner_cls):  # vLLM's class, chosen at run time
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pl_loading: set[str] = set()  # scheduler: requests whose KV the connector loads
            self._pl_step: StepTiming | None = None  # worker: the step being run
            self._pl_records: list[list[Any]] = []

        # scheduler side
        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens > 0:
                self._pl_loading.add(request.request_id)
            super().update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            metadata = super().build_connector_meta(scheduler_output)
            new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            saves, loads = step_requests(new, self._pl_loading)
            self._pl_loading.difference_update(loads)
            setattr(metadata, META_KEY, (saves, loads))
            return metadata

        def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            self._pl_loading.discard(request.request_id)  # finished (or aborted) before its load was scheduled
            return super().request_finished(request, *args, **kwargs)

        # worker side
        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            super().bind_connector_metadata(connector_metadata)
            self._pl_step = StepTiming(*getattr(connector_metadata, META_KEY, ((), ())))

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            step = self._pl_step or StepTiming()
            with step.load.timed():
                super().start_load_kv(forward_context, **kwargs)
            if step.loads:
                layers = getattr(forward_context, "no_compile_layers", {}).values()
                caches = [layer.kv_cache for layer in layers if getattr(layer, "kv_cache", None) is not None]
                moved = [example_connector_bytes(self._get_connector_metadata(), kv, False) for kv in caches]
                if caches and None not in moved:
                    step.load.add_bytes(sum(b for b in moved if b is not None))

        def wait_for_layer_load(self, layer_name: str) -> None:
            with (self._pl_step or StepTiming()).load.timed():
                super().wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            step = self._pl_step or StepTiming()
            with step.save.timed():
                super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
            moved = example_connector_bytes(self._get_connector_metadata(), kv_layer, True) if step.saves else None
            if moved is not None:
                step.save.add_bytes(moved)

        def wait_for_save(self) -> None:
            with (self._pl_step or StepTiming()).save.timed():
                super().wait_for_save()

        def get_kv_connector_stats(self) -> KVConnectorStats | None:
            """The step's records (the worker asks once per step, after its KV calls) beside the
            delegate's stats; on the scheduler side the delegate's alone, wrapped."""
            if self._pl_step is not None:
                self._pl_records += self._pl_step.records()
                self._pl_step = None
            inner = super().get_kv_connector_stats()
            if not self._pl_records and inner is None:
                return None
            records, self._pl_records = self._pl_records, []
            return stats_cls(data=merged(records, inner.data if inner is not None else None))

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
            return stats_cls(data=data) if data is not None else stats_cls(data=merged([], None))

    Timed.__name__ = Timed.__qualname__ = name
    return Timed, stats_cls


@functools.cache
def timed_connector(name: str) -> tuple[type, type[PhaselensKvStats]]:
    """`Phaselens<Name>` (vLLM's registered connector `<Name>`, timed) and its stats class."""
    return _timed(KVConnectorFactory.get_connector_class_by_name(name))


def __getattr__(name: str) -> type:
    """`Phaselens<Name>` (the timed connector) and `Phaselens<Name>Stats` (its stats class)."""
    stats = name.endswith(STATS)
    inner = name[len(PREFIX) : -len(STATS) if stats else None]
    if not name.startswith(PREFIX) or not inner:
        raise AttributeError(name)
    try:
        connector, stats_cls = timed_connector(inner)
    except ValueError as exc:  # not a connector vLLM registered
        raise AttributeError(f"{name}: {exc}") from None
    return stats_cls if stats else connector
