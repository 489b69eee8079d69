"""The C decoder under AddressSanitizer and UBSan: built here with gcc, fed mutated requests by
tests/fuzz_render.py. Any out-of-bounds read, use after free or undefined behaviour aborts the run."""

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


def test_decoder_is_clean_under_sanitizers(tmp_path):
    assert shutil.which("gcc"), "gcc builds the collector's decoder; it is needed here too"
    runtimes = [_runtime("libasan.so"), _runtime("libubsan.so")]
    module = tmp_path / "_otlp_rows_asan.so"
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
            str(ROOT / "collectors/_otlp_rows.c"),
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
        [sys.executable, str(ROOT / "tests/fuzz_render.py"), "--module", str(module), "--iterations", "30000"],
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
