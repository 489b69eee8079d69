"""OS names for phaselens's own threads, so per-thread CPU (`top -H`, /proc/PID/task/TID/comm) can tell
them from the host server's threads: Python 3.11 names a thread for `threading` only, not for the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PR_SET_NAME = 15  # prctl(2)
OS_NAME_CHARS = 15  # the kernel keeps 16 bytes, NUL included
THREAD_PREFIX = "pl-"  # every phaselens thread's OS name starts so (benchmarks/vllm_plugin_overhead.py)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def name_os_thread(name: str) -> None:
    """Give the calling thread the OS name `THREAD_PREFIX + name` (cut to 15 bytes); a no-op off Linux."""
    if _libc is not None:
        _libc.prctl(PR_SET_NAME, (THREAD_PREFIX + name).encode()[:OS_NAME_CHARS], 0, 0, 0)
