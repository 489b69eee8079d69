"""phaselens's threads carry OS names (`pl-*`) that per-thread CPU readers can tell apart."""

from __future__ import annotations

import threading
from pathlib import Path

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from phaselens.common.threads import OS_NAME_CHARS, THREAD_PREFIX, name_os_thread
from phaselens.instrumentation.pipeline.span_processor import CountingBatchSpanProcessor


def _os_names() -> dict[int, str]:
    """This process's threads' OS names by native id (threads that end meanwhile left out: other
    tests in this worker leave threads that end at their own pace)."""
    names = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            names[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:
            continue
    return names


def test_a_named_thread_shows_its_name_cut_to_the_kernels_15_bytes():
    seen: list[str] = []

    def run() -> None:
        name_os_thread("a-rather-long-thread-name")
        seen.append(_os_names()[threading.get_native_id()])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(THREAD_PREFIX + "a-rather-long-thread-name")[:OS_NAME_CHARS]]
    assert _os_names()[threading.get_native_id()] != seen[0]  # only the calling thread is renamed


class _Discard(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


def _export_workers() -> int:
    return list(_os_names().values()).count("pl-span-export")


def test_the_export_worker_is_named():
    before = _export_workers()  # other tests' processors may still run
    processor = CountingBatchSpanProcessor(_Discard())
    try:
        for _ in range(1000):  # the worker names itself as it starts: a bounded wait for it
            if _export_workers() > before:
                break
            threading.Event().wait(0.01)
        assert _export_workers() == before + 1
    finally:
        processor.shutdown()
