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

from phaselens.common.clocks import MonoTs, WallTs
from phaselens.instrumentation import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestInfo
from phaselens.instrumentation import names as n

from ._outputs import SWEEP_EVERY_STEPS, Batch
from .kv_timing import SAVE, records_of

_logger = logging.getLogger("vllm.phaselens")  # vLLM's handlers print it in its log format
# vLLM's FinishReason names → the observer's reasons
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT, "error": FINISH_ERROR}


def _mono_ts(seconds: float) -> MonoTs:
    """A vLLM `*_ts` stamp (`time.monotonic()`, s) as a monotonic instant in ns."""
    return MonoTs(int(seconds * 1e9))


def _wall_ts(seconds: float) -> WallTs:
    """A vLLM `time.time()` stamp (s) as a wall instant in ns."""
    return WallTs(int(seconds * 1e9))


class VllmTracker:
    """Open handles by vLLM request id and the output batch in hand (`batch`: its handles, stamps and
    engine step, in C; the hooks, `_outputs.BatchHook`, work on it directly and call the methods
    below only for what it leaves to Python)."""

    __slots__ = (
        "_abandoned",
        "_claimed",
        "_idle_reason",
        "_joined",
        "_open",
        "_states_of",
        "batch",
        "model",
        "telemetry",
    )

    def __init__(self, telemetry: Any, model: str) -> None:
        self.telemetry = telemetry
        self.model = model
        self._open: dict[str, Any] = {}  # vLLM request id → its handle (its vLLM state in `_states_of`)
        self._claimed: dict[str, Any] = {}  # vLLM request id → the HTTP request's handle, before its first output
        # a claimed handle → its vLLM request id, while it is claimed or open: a claim and the end of
        # its HTTP request find it at once, however many requests are in flight
        self._joined: dict[Any, str] = {}
        self._states_of: dict[str, Any] = {}  # vLLM request id → vLLM's RequestState, kept for aborts
        self._abandoned: set[str] = set()  # closed with their HTTP request while vLLM still runs them
        # the batch's state: the step's members and stamps, `finished_now` (finished in the current
        # output batch: its KV records come after, update_scheduler_stats), vLLM's live requests
        self.batch = Batch(self._open, telemetry.step_observer, telemetry.clock_ns)
        self._idle_reason: str | None = None

    @property
    def idle_reason(self) -> str | None:
        return self._idle_reason

    def idle(self, reason: str) -> None:
        """Stop tracking (one log line): vLLM runs without what the plugin needs."""
        if self._idle_reason is None:
            self._idle_reason = reason
            self.batch.idle = True
            _logger.warning("phaselens: no spans from this vLLM: %s", reason)

    # --- per output batch (process_outputs): what `batch.before` / `batch.after` leave to Python ---
    def first_sights(self, outputs: list) -> list:
        """`batch.before` for a batch in which some request has no open handle yet: flat (handle, new
        tokens, stats on a first sight, else None) triples, one per output of a known request, each
        request opened here (or skipped: not vLLM's any more, or abandoned). Never called once idle:
        `batch.before` answers [] then."""
        opened, states = self._open, self.batch.states or {}
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

    def after_first_sights(self, seen: list, now: MonoTs) -> None:
        """`batch.after` for a batch with a first sight: stamp first token / tokens at `now`, add the
        handles to the step's members and, from a request first scheduled in it, when the step started."""
        batch = self.batch
        triples = iter(seen)
        for handle, tokens, first_stats in zip(triples, triples, triples, strict=True):
            if first_stats is not None:
                handle.first_token_ts = now
                batch.first_tokens += 1
                batch.scheduled_ts = max(batch.scheduled_ts, _mono_ts(first_stats.scheduled_ts))
                if tokens > 1:
                    handle.token_at(now, tokens - 1)
            elif tokens:
                handle.token_at(now, tokens)
            batch.members.append(handle)

    def claim(self, req_id: str, handle: Any, states: dict) -> bool:
        """vLLM added request `req_id` (its state in the output processor's `states`) while running
        the HTTP request of `handle` (opened by the delivery middleware): that handle becomes the
        request's, True. With n > 1 the first child takes it (False for the others)."""
        self.batch.states = states
        if handle in self._joined:
            return False
        self._claimed[req_id] = handle
        self._joined[handle] = req_id
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
        self._joined.pop(handle, None)
        self.batch.finished_now[req_state.request_id] = handle
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

    # --- per engine iteration (update_scheduler_stats): `batch.step` records it ---------------------
    def step_work(self, scheduler_stats: Any) -> None:
        """What `batch.step` leaves to Python, when it says so: the KV connector's records of the step
        and the requests finished in it, and every SWEEP_EVERY_STEPS steps the sweep of requests that
        vanished without finishing."""
        kv_stats = getattr(scheduler_stats, "kv_connector_stats", None)
        if kv_stats is not None or self.batch.finished_now:
            self._kv_moved(records_of(kv_stats))
        if self.batch.steps_seen % SWEEP_EVERY_STEPS == 0:
            self._close_vanished()

    def _kv_moved(self, records: list[list[Any]]) -> None:
        """The KV connector's records of this batch's step (`kv_timing.py`) into the requests' handles:
        open, claimed, or finished in this batch (its record arrives after `do_tracing`; the handle
        is the delivery middleware's, closed only when the response ends)."""
        finished = dict(self.batch.finished_now)
        self.batch.finished_now.clear()
        for req_id, op, start_ts, end_ts, busy_ns, nbytes in records:
            handle = self._open.get(req_id) or self._claimed.get(req_id) or finished.get(req_id)
            if handle is not None:
                handle.kv_moved(op == SAVE, MonoTs(start_ts), MonoTs(end_ts), busy_ns, nbytes)

    def _close_vanished(self) -> None:
        """Requests aborted before finishing never reach `do_tracing`: close them as aborted."""
        live = self.batch.states
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
        req_id = self._joined.get(handle)
        if req_id is None:
            return
        self._abort(req_id)
        if req_id in (self.batch.states or {}):
            self._abandoned.add(req_id)

    def _abort(self, req_id: str) -> None:
        handle = self._open.pop(req_id) if req_id in self._open else self._claimed.pop(req_id)
        self._joined.pop(handle, None)
        state = self._states_of.pop(req_id, None)
        if state is not None:
            self._settle(handle, state, FINISH_ABORT)
        handle.fail(n.ERROR_CLIENT_DISCONNECTED)  # closes the handle (the middleware's: at the response's end)
