"""Mutation fuzzing of the C decoder (collectors/_otlp_rows.c), meant to run under sanitizers.

Mutates valid requests (byte flips, cuts, inserted and duplicated slices) and checks that every
input either raises InvalidSpans or is accepted by protobuf too. Each input lies in a buffer of its
exact size (a bytes object has a spare NUL byte that would hide a read one past the end). Prints one JSON object. Under
AddressSanitizer/UBSan (what tests/test_collector_render_asan.py does):

    gcc -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fPIC -shared \\
        -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \\
        collectors/_otlp_rows.c -o /tmp/_otlp_rows_asan.so
    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1 PYTHONMALLOC=malloc \\
        LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \\
        .venv/bin/python tests/fuzz_render.py --module /tmp/_otlp_rows_asan.so --iterations 300000
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODULE = "phaselens.collectors._otlp_rows"


def load(name: str, path: str) -> None:
    """Puts the extension module `name` built at `path` in place of the installed one."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    sys.modules[name] = module


def arguments(doc: str, name: str, iterations: int) -> argparse.Namespace:
    """A fuzzer's command line (--module, --iterations, --seed), with the module given loaded as `name`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--module", help=f"a build of {name} to use (e.g. with sanitizers)")
    parser.add_argument("--iterations", type=int, default=iterations)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.module:
        load(name, args.module)
    return args


def _seeds() -> list[bytes]:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    from tests.collector_payloads import export_request

    rich = export_request(3, 5)
    span = rich.resource_spans[0].scope_spans[0].spans[0]
    link = span.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, trace_state="a=b")
    link.attributes.add(key="x", value=AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=1.5)])))
    span.status.message, span.status.code = "boom", 2
    for i in range(80):  # past 64 entries: the map's hash index
        span.attributes.add(key=f"k{i % 70}", value=AnyValue(int_value=i))
    rich.resource_spans[0].resource.entity_refs.add(type="t", id_keys=["a"])
    rich.resource_spans[0].scope_spans[0].scope.attributes.add(key="s", value=AnyValue(bytes_value=b"\x00\xff"))
    return [export_request(8, 1_700_000_000_000_000_000).SerializeToString(), rich.SerializeToString()]


def _mutate(rng: random.Random, data: bytearray) -> bytes:
    for _ in range(rng.randint(1, 4)):
        op, pos = rng.random(), rng.randrange(len(data)) if data else 0
        if op < 0.4 and data:
            data[pos] = rng.randrange(256)
        elif op < 0.6:
            del data[pos:]
        elif op < 0.8:
            data[pos:pos] = rng.randbytes(rng.randint(1, 4))
        else:
            start = rng.randrange(len(data)) if data else 0
            data[pos:pos] = data[start : start + rng.randint(1, 40)]
    return bytes(data)


def main() -> None:
    args = arguments(__doc__, MODULE, 100_000)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from phaselens.collectors import render

    rng, seeds, accepted = random.Random(args.seed), _seeds(), 0
    for _ in range(args.iterations):
        data = _mutate(rng, bytearray(rng.choice(seeds)))
        exact = (ctypes.c_char * len(data)).from_buffer_copy(data)  # no slack after: a read past shows
        try:
            rows, _ = render.render(exact)
        except render.InvalidSpans:
            continue
        assert sum(map(len, render.render_slots(exact, 3)[0])) == len(rows)  # the split path, sanitized too
        ExportTraceServiceRequest.FromString(data)  # what the decoder accepted, protobuf accepts too
        accepted += 1
    print(json.dumps({"iterations": args.iterations, "accepted": accepted, "module": sys.modules[MODULE].__file__}))


if __name__ == "__main__":
    main()
