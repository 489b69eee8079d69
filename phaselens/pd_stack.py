"""A disaggregated deployment on one machine: the stack's pipeline (ClickHouse, schema, collector),
one prefill instance, `decode_count` decode instances and the router, each a `phaselens serve`
process, tracing to the collector. Processes on loopback are the hosts here.

`skews` gives a role (router, prefill, decode) its own wall clock through libfaketime
(`FAKETIME=<offset>`, e.g. "-1h"; FAKETIME_DONT_FAKE_MONOTONIC=1, so durations are untouched): the
budget's terms are durations on one clock each, so they must not move when the clocks disagree.
Stop order is the data-flow order: router, decode, prefill (each flushes its spans), then the
pipeline.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Self

from phaselens.common.process import LOOPBACK
from phaselens.instrumentation import names
from phaselens.stack import Child, ServedStack, StackError, spawn

FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
ROLE_SERVICES = {"router": names.SERVER_SERVICE_NAME, "prefill": "phaselens-prefill", "decode": "phaselens-decode"}


def faketime_library() -> str:
    """The libfaketime preload library (Debian: apt-get install faketime)."""
    for path in (*FAKETIME_LIBS, *glob.glob("/usr/lib/*/faketime/libfaketime.so.1")):
        if os.path.exists(path):
            return path
    raise StackError("libfaketime not found: apt-get install faketime (./setup.sh --test installs it)")


@dataclass(slots=True)
class PdStack(ServedStack):
    decode_count: int = 1
    skews: dict[str, str] = field(default_factory=dict)  # role → FAKETIME offset, e.g. {"prefill": "-1h"}
    engine_args: tuple[str, ...] = ()  # flags for both instances (e.g. --max-num-batched-tokens)
    preload: tuple[str, ...] = ()  # libraries preloaded before libfaketime in the skewed processes
    prefill: Child | None = field(default=None, init=False)
    decodes: list[Child] = field(default_factory=list, init=False)
    router: Child | None = field(default=None, init=False)

    @property
    def router_url(self) -> str:
        return self.router.url if self.router else ""

    def env(self, role: str) -> dict[str, str]:
        env = self.stack.otel_env(ROLE_SERVICES[role])
        env["PHASELENS_SPAN_BUILDER"] = "thread"  # one process per host: fewer processes on a small machine
        if role in self.skews:
            preload = " ".join((*self.preload, faketime_library()))
            env.update(LD_PRELOAD=preload, FAKETIME=self.skews[role], FAKETIME_DONT_FAKE_MONOTONIC="1")
        return env

    def start_servers(self, on_phase=lambda phase: None) -> Self:
        """Both instances together, then the router in front of them (the pipeline already runs)."""
        on_phase("prefill and decode instances")
        base = ["serve", "--model", self.stack.model, "--host", LOOPBACK, "--port", "0", *self.engine_args]
        log_dir = self.stack.log_dir
        self.prefill = spawn("prefill", [*base, "--role", "prefill"], log_dir, self.env("prefill"))
        self.decodes = [
            spawn(f"decode{i}", [*base, "--role", "decode"], log_dir, self.env("decode"))
            for i in range(self.decode_count)
        ]
        for child in (self.prefill, *self.decodes):
            child.wait_ready(self.stack.ready_timeout_s)
        on_phase("router")
        argv = ["serve", "--role", "router", "--host", LOOPBACK, "--port", "0", "--prefill", self.prefill.url]
        self.router = spawn("router", [*argv, "--decode", *(d.url for d in self.decodes)], log_dir, self.env("router"))
        self.router.wait_ready(self.stack.ready_timeout_s)
        return self

    def stop_servers(self) -> dict[str, int]:
        codes: dict[str, int] = {}
        for child in (self.router, *self.decodes, self.prefill):
            if child is not None:
                codes[child.name] = child.stop(self.stack.stop_timeout_s)
        self.router, self.decodes, self.prefill = None, [], None
        return codes

    def bench(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """`phaselens bench --url <router> <argv>`, client spans to the collector (no clock skew)."""
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", self.router_url, *argv],
            env=self.stack.otel_env("phaselens-loadgen"),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise StackError(f"bench failed after {time.monotonic() - start:.0f} s:\n{done.stderr[-2000:]}")
        return done
