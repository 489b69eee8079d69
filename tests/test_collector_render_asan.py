"""The C modules under AddressSanitizer and UBSan: built here with gcc, the collector's decoder fed
mutated requests by tests/fuzz_render.py, the span encoder random and broken inputs by
tests/fuzz_encode.py, the shipper's packer random and broken records by tests/fuzz_wire_pack.py, the timeline's token stamps random and broken calls by tests/fuzz_stamps.py, the C modules that write a request's handle on the event loop (the vLLM plugin's `_outputs.c`, the middleware's `_send_guard.c`) by tests/fuzz_handle_writers.py. Any out-of-bounds access, use after free or undefined behaviour aborts the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _runtime(name: str) -> str:
    path = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip(f"gcc's {name} is not installed (Debian: libgcc-12-dev)")
    return path


@pytest.mark.parametrize(
    ("source", "fuzzer", "iterations"),
    [
        ("collectors/_otlp_rows.c", "tests/fuzz_render.py", 30000),
        ("instrumentation/pipeline/_otlp_encode.c", "tests/fuzz_encode.py", 20000),
        ("instrumentation/process/_wire_pack.c", "tests/fuzz_wire_pack.py", 20000),
        ("instrumentation/hotpath/_stamps.c", "tests/fuzz_stamps.py", 20000),
        ("integrations/vllm/_outputs.c", "tests/fuzz_handle_writers.py", 5000),
        ("instrumentation/server/_send_guard.c", "tests/fuzz_handle_writers.py", 5000),
    ],
)
def test_c_module_is_clean_under_sanitizers(tmp_path, source, fuzzer, iterations):
    """The collector's decoder, the span encoder (fed random and broken steps, descriptions and request
    phases), the shipper's packer (random and broken records) and the timeline's token stamps (random and
    broken calls)."""
    assert shutil.which("gcc"), "gcc builds the C modules; it is needed here too"
    runtimes = [_runtime("libasan.so"), _runtime("libubsan.so")]
    module = tmp_path / f"{Path(source).stem}_asan.so"
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-g",
            "-fsanitize=address,undefined",
            "-fno-omit-frame-pointer",
            "-fPIC",
            "-shared",
            f"-I{sysconfig.get_paths()['include']}",
            str(ROOT / source),
            "-o",
            str(module),
        ],
        check=True,
    )
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=0",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONMALLOC="malloc",
        LD_PRELOAD=" ".join(runtimes),
    )
    run = subprocess.run(
        [sys.executable, str(ROOT / fuzzer), "--module", str(module), "--iterations", str(iterations)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    assert result["module"] == str(module)  # the sanitized build ran, not the installed one
    assert 0 < result["accepted"] < result["iterations"]
    if fuzzer == "tests/fuzz_encode.py":  # and request phases, valid ones and broken ones
        assert 0 < result["phases_accepted"] < iterations // 4
        assert 0 < result["roots_accepted"] < iterations // 4
