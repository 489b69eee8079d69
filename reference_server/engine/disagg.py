"""Disaggregated prefill and decode in the engine: what a prefill instance sends and a decode
instance receives (docs/disaggregation.md).

Prefill instance: a request submitted with a `KvHandoff` runs its prefill in the instance's own
batch; after its first token the engine detaches it (its blocks stay held) and the `KvSender`
thread, off the loop, copies the blocks out of the KV pool, sends them with the tokens to the
decode instance (`kv_transfer.send`) and waits for the acknowledgement; then the engine frees the
blocks and finishes the request (`FINISH_TRANSFERRED`, or `FINISH_ERROR` with the reason).

    kv_wait     = send start − first token      (the request waited for the sender thread)
    kv_transfer = acknowledgement − send start  (copy out, send, the receiver's write, its ack)

both on the prefill instance's monotonic clock.

Decode instance: the `KvReceiver` hands each transfer to `Engine.receive_kv`, which the loop
stages (blocks reserved, the bytes written into the pool) before the ack goes back; the request
that follows names the transfer and `Engine.claim`s it, and the sequence continues in the decode
instance's batch. A transfer nobody claims within `stage_timeout_s` is freed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from phaselens.common.clocks import NOT_STAMPED, MonoTs, monotonic_ts
from phaselens.reference_server.engine import kv_transfer
from phaselens.reference_server.engine.kv_cache import PagedKVCache
from phaselens.reference_server.engine.sequence import Sequence

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 30.0
DEFAULT_STAGE_TIMEOUT_S = 60.0


@dataclass(slots=True)
class KvHandoff:
    """Where one request's KV goes, and (set by the sender, monotonic ns) how the transfer went."""

    address: tuple[str, int]
    transfer_id: str
    traceparent: str = ""  # the trace context the decode instance's receive span joins
    send_start_ts: MonoTs = NOT_STAMPED
    ack_ts: MonoTs = NOT_STAMPED
    kv_bytes: int = 0
    received_bytes: int = 0  # as the receiver's ack reports it
    error: str = ""


@dataclass(slots=True)
class ReceivedKv:
    """A transfer on its way into a decode instance's KV pool; `done` once the loop staged it."""

    transfer: kv_transfer.Transfer
    received_ts: MonoTs  # the header and bytes read (monotonic ns of this instance)
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""

    @property
    def transfer_id(self) -> str:
        return str(self.transfer.header.get("transfer_id", ""))


def transfer_header(seq: Sequence, handoff: KvHandoff, cache: PagedKVCache, model: str) -> dict[str, object]:
    return {
        "transfer_id": handoff.transfer_id,
        "model": model,
        "token_ids": seq.token_ids,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_blocks": len(seq.block_table),
        "bytes_per_block": cache.bytes_per_block(),
        "traceparent": handoff.traceparent,
    }


def check_header(header: dict[str, object], cache: PagedKVCache, model: str, max_model_len: int) -> None:
    """Refuse a transfer this instance cannot continue: another model, another KV layout, tokens
    that do not fit the blocks sent, or byte counts other than those blocks' (checked before the
    bytes are read: a garbled length allocates nothing)."""
    tokens = header.get("token_ids")
    prompt = header.get("num_prompt_tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("token_ids must be a list of token ids")
    if not isinstance(prompt, int) or not 0 < prompt < len(tokens) or len(tokens) > max_model_len:
        raise ValueError(f"bad token counts: {prompt} prompt tokens of {len(tokens)} (context {max_model_len})")
    if header.get("model") != model:
        raise ValueError(f"model {header.get('model')!r} is not this instance's {model!r}")
    if header.get("bytes_per_block") != cache.bytes_per_block():
        raise ValueError(
            f"KV layout differs: {header.get('bytes_per_block')} bytes per block, here {cache.bytes_per_block()}"
        )
    block_size = cache.block_shape[1]
    blocks = -(-prompt // block_size)
    if header.get("num_blocks") != blocks:
        raise ValueError(f"{header.get('num_blocks')} blocks for {prompt} prompt tokens of block size {block_size}")
    sizes, expected = header.get("part_bytes"), blocks * cache.bytes_per_block()
    if isinstance(sizes, list) and (len(sizes) != 2 * len(cache.keys) or sum(sizes) != expected):
        raise ValueError(
            f"{len(sizes)} tensors of {sum(sizes)} bytes: this cache takes {2 * len(cache.keys)} "
            f"of {expected} bytes in all for {blocks} blocks"
        )


class KvSender:
    """One thread sending detached sequences' KV in turn; `release(seq_id)` tells the engine the
    transfer is over (the handoff says how), on the sender's thread."""

    def __init__(
        self,
        cache: PagedKVCache,
        model: str,
        release: Callable[[int], None],
        timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        self._cache, self._model, self._release, self._timeout_s = cache, model, release, timeout_s
        self._queue: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(self, seq: Sequence) -> None:
        self._queue.put(seq)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(self._timeout_s + 1)

    def _run(self) -> None:
        while (seq := self._queue.get()) is not None:
            self._send(seq)
            self._release(seq.seq_id)

    def _send(self, seq: Sequence) -> None:
        handoff = seq.handoff
        assert isinstance(handoff, KvHandoff)
        handoff.send_start_ts = monotonic_ts()
        try:
            parts = self._cache.export_blocks(list(seq.block_table))
            header = transfer_header(seq, handoff, self._cache, self._model)
            handoff.kv_bytes = sum(len(p) for p in parts)
            ack = kv_transfer.send(handoff.address, header, parts, self._timeout_s)
            handoff.received_bytes = int(ack.get("bytes", 0))
            if handoff.received_bytes != handoff.kv_bytes:
                raise kv_transfer.KvTransferError(
                    f"the decode instance received {handoff.received_bytes} of {handoff.kv_bytes} bytes"
                )
        except (OSError, kv_transfer.KvTransferError) as exc:
            host, port = handoff.address
            handoff.error = f"KV transfer to the decode instance {host}:{port} failed: {exc}"
            log.warning("%s", handoff.error)
        handoff.ack_ts = monotonic_ts()
