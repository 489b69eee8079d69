"""vLLM's per-request and per-step facts → phaselens request handles and step records.

Runs on vLLM's API-server event-loop thread, inside its output handler (the hooks in `hooks.py`),
so it only stamps integers into the handles and the step recorder of a `ServerTelemetry`; the
span builder (thread or child process) turns them into the phaselens span tree off that thread.

Where each stamp comes from (ns, all on this host's CLOCK_MONOTONIC: vLLM's API server and
EngineCore both read `time.monotonic()`, one system-wide clock):

    received     RequestStateStats.arrival_time (the API server's wall clock at arrival, before
                 tokenisation), converted once through this process's anchor
    enqueued     queued_ts      the EngineCore queued it (QUEUED event)
    scheduled    scheduled_ts   first scheduled (SCHEDULED event)
    prefill      [scheduled_ts, first_token_ts]  one chunk, the whole prompt (vLLM does not report
                 chunk boundaries to the API server); first_token_ts is the EngineCore's stamp of
                 the output batch that carried the first token
    first_token  the API server handed the first token to the request's stream (right after
                 `process_outputs` put it in the request's queue)
    token        the same, for each later output of the request
    kv_save, kv_load      the KV connector's calls for the request (a `Phaselens<Name>` connector,
                 `kv_connector.py`): records in the batch's KV-connector stats, the worker's clock
    finished, responded   the output processor finished the request (`do_tracing`); vLLM's
                 streaming of the last bytes is not observed, so delivery ends here

So llm.ingress = tokenisation + the hop into the EngineCore; llm.first_token = the first token's
way back from the EngineCore to the API server's stream.
"""

from __future__ import annotations

import logging
from typing import Any

from phaselens.common.clocks import NOT_STAMPED, MonoTs, WallTs
from phaselens.instrumentation import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestInfo
from phaselens.instrumentation import names as n

from ._outputs import engine_step, open_outputs, stamp_tokens
from .kv_timing import SAVE, records_of

_logger = logging.getLogger("vllm.phaselens")  # vLLM's handlers print it in its log format
# vLLM's FinishReason names → the observer's reasons
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT, "error": FINISH_ERROR}
SWEEP_EVERY_STEPS = 32  # how often requests that vanished without finishing (aborts) are closed


def _mono_ts(seconds: float) -> MonoTs:
    """A vLLM `*_ts` stamp (`time.monotonic()`, s) as a monotonic instant in ns."""
    return MonoTs(int(seconds * 1e9))


def _wall_ts(seconds: float) -> WallTs:
    """A vLLM `time.time()` stamp (s) as a wall instant in ns."""
    return WallTs(int(seconds * 1e9))


class VllmTracker:
    """Open handles by vLLM request id, the current step's members, and the step recorder."""

    __slots__ = (
        "_abandoned",
        "_claimed",
        "_finished_now",
        "_idle_reason",
        "_open",
        "_prev_step_end_ts",
        "_states",
        "_states_of",
        "_step_end_s",
        "_step_first_tokens",
        "_step_handles",
        "_step_iteration",
        "_step_scheduled_ts",
        "_steps_seen",
        "clock_ns",
        "model",
        "telemetry",
    )

    def __init__(self, telemetry: Any, model: str) -> None:
        self.telemetry = telemetry
        self.model = model
        self.clock_ns = telemetry.clock_ns
        self._open: dict[str, Any] = {}  # vLLM request id → its handle (its vLLM state in `_states_of`)
        self._claimed: dict[str, Any] = {}  # vLLM request id → the HTTP request's handle, before its first output
        self._states_of: dict[str, Any] = {}  # vLLM request id → vLLM's RequestState, kept for aborts
        self._abandoned: set[str] = set()  # closed with their HTTP request while vLLM still runs them
        # finished in the current output batch: its KV records come after (update_scheduler_stats)
        self._finished_now: dict[str, Any] = {}
        self._states: dict | None = None  # the output processor's live requests (its own dict)
        self._step_handles: list = []
        self._step_first_tokens = 0
        self._step_scheduled_ts = NOT_STAMPED  # latest first scheduling among the step's new requests
        self._step_end_s: float | None = None  # the EngineCore's stamp of the current output batch
        self._step_iteration: Any = None  # vLLM's IterationStats of the current output batch
        self._prev_step_end_ts = NOT_STAMPED
        self._steps_seen = 0
        self._idle_reason: str | None = None

    @property
    def idle_reason(self) -> str | None:
        return self._idle_reason

    def idle(self, reason: str) -> None:
        """Stop tracking (one log line): vLLM runs without what the plugin needs."""
        if self._idle_reason is None:
            self._idle_reason = reason
            _logger.warning("phaselens: no spans from this vLLM: %s", reason)

    # --- per output batch (process_outputs) -----------------------------------------------------
    def before_outputs(self, processor: Any, outputs: list, timestamp_s: float | None, iteration_stats: Any) -> list:
        """Before vLLM processes (a slice of) a batch: flat (handle, new tokens, stats on a first sight,
        else None) triples, one per output of a known request (`_outputs.open_outputs` when every
        output's request is open, the usual batch). `timestamp_s`, the EngineCore's monotonic stamp
        of the batch, is the step's end."""
        if self._idle_reason is not None:
            return []
        self._step_end_s, self._step_iteration = timestamp_s, iteration_stats
        self._states = states = processor.request_states
        seen = open_outputs(outputs, self._open)
        return seen if seen is not None else self._first_sights(states, outputs)

    def _first_sights(self, states: dict, outputs: list) -> list:
        """`before_outputs` for a batch in which some request has no open handle yet: opened here
        (or skipped: not vLLM's any more, or abandoned)."""
        opened = self._open
        seen: list[Any] = []
        for output in outputs:
            req_id = output.request_id
            handle = opened.get(req_id)
            stats = None
            if handle is None:
                state = states.get(req_id)
                if state is None or req_id in self._abandoned:
                    continue
                if state.stats is None:
                    self.idle("vLLM runs with --disable-log-stats, so it keeps no per-request timestamps")
                    return []
                handle, stats = self._open_handle(req_id, state, output.trace_headers), state.stats
            seen += (handle, len(output.new_token_ids), stats)
        return seen

    def after_outputs(self, seen: list) -> None:
        """The batch is in the requests' streams: stamp first token / tokens, remember the step's
        members and, from a request first scheduled in it, when the step started (in C,
        `_outputs.stamp_tokens`, unless a request was first seen in it)."""
        now = self.clock_ns()
        if stamp_tokens(seen, now, self._step_handles):
            return
        triples = iter(seen)
        for handle, tokens, first_stats in zip(triples, triples, triples, strict=True):
            if first_stats is not None:
                handle.first_token_ts = now
                self._step_first_tokens += 1
                self._step_scheduled_ts = max(self._step_scheduled_ts, _mono_ts(first_stats.scheduled_ts))
                if tokens > 1:
                    handle.token_at(now, tokens - 1)
            elif tokens:
                handle.token_at(now, tokens)
            self._step_handles.append(handle)

    def claim(self, req_id: str, handle: Any, states: dict) -> bool:
        """vLLM added request `req_id` (its state in the output processor's `states`) while running
        the HTTP request of `handle` (opened by the delivery middleware): that handle becomes the
        request's, True. With n > 1 the first child takes it (False for the others)."""
        self._states = states
        if any(h is handle for h in self._claimed.values()) or any(h is handle for h in self._open.values()):
            return False
        self._claimed[req_id] = handle
        self._states_of[req_id] = states.get(req_id)
        return True

    def _open_handle(self, req_id: str, state: Any, trace_headers: Any) -> Any:
        """The delivery middleware's handle for this request, else one opened now (received =
        vLLM's arrival time, the trace context from vLLM's trace headers), closed at `finished`."""
        handle = self._claimed.pop(req_id, None)
        self._states_of[req_id] = state
        if handle is not None:
            self._open[req_id] = handle
            return handle
        anchor = self.telemetry.anchor
        received_ts = anchor.to_mono_ts(_wall_ts(state.stats.arrival_time))
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (trace_headers or {}).items()]
        handle = self.telemetry.open_request(
            {"headers": headers, "method": "POST"}, managed=False, received_ts=received_ts
        )
        self._open[req_id] = handle
        return handle

    # --- per finished request (do_tracing) -------------------------------------------------------
    def finished(self, req_state: Any, finish_reason: Any) -> None:
        handle = self._open.pop(req_state.request_id, None)
        self._states_of.pop(req_state.request_id, None)
        self._abandoned.discard(req_state.request_id)  # its handle was closed when its client left
        if handle is None:
            return
        self._finished_now[req_state.request_id] = handle
        reason = str(getattr(finish_reason, "name", finish_reason) or "").lower()
        self._settle(handle, req_state, FINISH_REASONS.get(reason, reason))
        handle.complete(
            output_tokens=req_state.stats.num_generation_tokens,
            finish_reason=reason or None,
            cached_tokens=req_state.num_cached_tokens,
        )  # closes the handle: to the builder

    def _settle(self, handle: Any, req_state: Any, reason: str) -> None:
        """What a finished or aborted request is: the EngineCore's stamps, its description, `finished`."""
        self._stamp_engine(handle, req_state.stats, req_state.prompt_len, req_state.num_cached_tokens)
        external = req_state.external_req_id
        operation = n.OP_CHAT if str(external).startswith("chatcmpl") else n.OP_TEXT_COMPLETION
        handle.describe(
            RequestInfo(
                operation,
                req_state.lora_name or self.model,
                request_id=external,
                input_tokens=req_state.prompt_len,
                max_tokens=req_state.max_tokens_param,
                temperature=req_state.temperature,
                top_p=req_state.top_p,
                stream=True,
            )
        )
        handle.finished(reason)

    @staticmethod
    def _stamp_engine(handle: Any, stats: Any, prompt_tokens: int, cached_tokens: int) -> None:
        """The EngineCore's stamps, known once its events arrived: one queue wait, one prefill chunk."""
        if stats is None or not stats.queued_ts:  # none yet: vLLM lost it before the EngineCore queued it
            return
        queued, scheduled, first = (
            _mono_ts(stats.queued_ts),
            _mono_ts(stats.scheduled_ts),
            _mono_ts(stats.first_token_ts),
        )
        handle.enqueued_ts = queued
        handle.waits.extend((queued, scheduled or queued))
        if scheduled and first:
            handle.prefill_chunk(scheduled, first, prompt_tokens, cached_tokens)

    # --- per engine iteration (update_scheduler_stats) -------------------------------------------
    def step_done(self, scheduler_stats: Any) -> None:
        """One EngineCore output batch was processed: one `llm.engine_step`, linked to its requests.

        vLLM does not hand the API server a step's start, so it is inferred on the EngineCore's clock:
            start = max(end of the previous output batch, first scheduling of a request new in this one)
        (the engine was busy since the previous batch, or idle until it scheduled the new request);
        `prefill_tokens` are the prompt tokens of the requests whose prefill ended in this step;
        `decode_tokens` = max(0, generated tokens − first tokens); KV use = round(kv_cache_usage ×
        KV_SCALE) per KV_SCALE; end = the batch's EngineCore stamp (now, without one)."""
        kv_stats = getattr(scheduler_stats, "kv_connector_stats", None)
        if kv_stats is not None or self._finished_now:  # most steps have neither: two calls less
            self._kv_moved(records_of(kv_stats))
        end_s, iteration_stats = self._step_end_s, self._step_iteration
        self._step_end_s = self._step_iteration = None
        members, self._step_handles = self._step_handles, []
        first_tokens, self._step_first_tokens = self._step_first_tokens, 0
        self._steps_seen += 1
        if self._steps_seen % SWEEP_EVERY_STEPS == 0:
            self._close_vanished()
        if not members or self._idle_reason is not None:
            return
        # the record made and handed on in C, by the formulas above (`_outputs.engine_step`)
        floor_ts = max(self._prev_step_end_ts, self._step_scheduled_ts)
        self._prev_step_end_ts = engine_step(
            self.telemetry.step_observer,
            members,
            scheduler_stats,
            iteration_stats,
            end_s,
            floor_ts,
            first_tokens,
            self.clock_ns,
        )
        self._step_scheduled_ts = NOT_STAMPED

    def _kv_moved(self, records: list[list[Any]]) -> None:
        """The KV connector's records of this batch's step (`kv_timing.py`) into the requests' handles:
        open, claimed, or finished in this batch (its record arrives after `do_tracing`; the handle
        is the delivery middleware's, closed only when the response ends)."""
        finished, self._finished_now = self._finished_now, {}
        for req_id, op, start_ts, end_ts, busy_ns, nbytes in records:
            handle = self._open.get(req_id) or self._claimed.get(req_id) or finished.get(req_id)
            if handle is not None:
                handle.kv_moved(op == SAVE, MonoTs(start_ts), MonoTs(end_ts), busy_ns, nbytes)

    def _close_vanished(self) -> None:
        """Requests aborted before finishing never reach `do_tracing`: close them as aborted."""
        live = self._states
        if live is None:
            return
        for req_id in [r for r in self._open if r not in live]:
            self._abort(req_id)
        self._abandoned.intersection_update(live)

    def http_done(self, handle: Any) -> None:
        """The delivery middleware's request ended (vLLM's app returned). A vLLM request that
        finished reached `do_tracing` before its last output could reach the app, so one still joined
        to the handle was left unfinished (its client went away), whether cut before its first
        output (claimed) or after (open): closed as aborted now, before the middleware hands the
        handle on. One vLLM still runs (it was cancelled while vLLM added it, so vLLM never aborts
        it) is `abandoned`: its later outputs open no second handle."""
        live = self._states or {}
        for req_id in [r for r, h in (*self._open.items(), *self._claimed.items()) if h is handle]:
            self._abort(req_id)
            if req_id in live:
                self._abandoned.add(req_id)

    def _abort(self, req_id: str) -> None:
        handle = self._open.pop(req_id) if req_id in self._open else self._claimed.pop(req_id)
        state = self._states_of.pop(req_id, None)
        if state is not None:
            self._settle(handle, state, FINISH_ABORT)
        handle.fail(n.ERROR_CLIENT_DISCONNECTED)  # closes the handle (the middleware's: at the response's end)
