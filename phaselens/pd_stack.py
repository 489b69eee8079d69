"""A disaggregated deployment on one machine: the stack's pipeline (ClickHouse, schema, collector),
one prefill instance, `decode_count` decode instances and the router, tracing to the collector.
The instances are `phaselens serve` processes (`ReferenceInstances`) or what `instances` launches
(a vLLM per role: integrations/vllm/pd.py), the router speaking their protocol. Processes on
loopback are the hosts here.

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
from pathlib import Path
from typing import Protocol, Self

from phaselens.common.process import LOOPBACK
from phaselens.instrumentation import names
from phaselens.reference_server.pd.pd_protocol import PROTOCOL_PHASELENS
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


class Instance(Protocol):
    """A started P/D instance: a `phaselens serve` child, or a vLLM server."""

    @property
    def url(self) -> str: ...

    def wait_ready(self, timeout_s: float) -> str: ...

    def stop(self, timeout_s: float) -> int | None: ...


class Instances(Protocol):
    """What launches the prefill and decode instances, and the protocol the router speaks to them."""

    @property
    def protocol(self) -> str: ...

    def launch(self, role: str, name: str, log_dir: Path, env: dict[str, str]) -> Instance: ...


@dataclass(slots=True)
class ReferenceInstances:
    """`phaselens serve --role prefill|decode` on the stack's model."""

    model: str = "tiny"
    engine_args: tuple[str, ...] = ()  # flags for both instances (e.g. --max-num-batched-tokens)
    protocol: str = PROTOCOL_PHASELENS

    def launch(self, role: str, name: str, log_dir: Path, env: dict[str, str]) -> Instance:
        argv = ["serve", "--model", self.model, "--host", LOOPBACK, "--port", "0", *self.engine_args]
        return spawn(name, [*argv, "--role", role], log_dir, env)


@dataclass(slots=True)
class PdStack(ServedStack):
    decode_count: int = 1
    skews: dict[str, str] = field(default_factory=dict)  # role → FAKETIME offset, e.g. {"prefill": "-1h"}
    instances: Instances | None = None  # None: the reference server on the stack's model
    preload: tuple[str, ...] = ()  # libraries preloaded before libfaketime in the skewed processes
    prefill: Instance | None = field(default=None, init=False)
    decodes: list[Instance] = field(default_factory=list, init=False)
    router: Child | None = field(default=None, init=False)

    @property
    def router_url(self) -> str:
        return self.router.url if self.router else ""

    @property
    def launcher(self) -> Instances:
        return self.instances or ReferenceInstances(self.stack.model)

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
        launcher, log_dir = self.launcher, self.stack.log_dir
        self.prefill = launcher.launch("prefill", "prefill", log_dir, self.env("prefill"))
        for i in range(self.decode_count):
            self.decodes.append(launcher.launch("decode", f"decode{i}", log_dir, self.env("decode")))
        for instance in (self.prefill, *self.decodes):
            instance.wait_ready(self.stack.ready_timeout_s)
        on_phase("router")
        self.router = self.spawn_router("router", self.prefill.url)
        return self

    def spawn_router(self, name: str, prefill_url: str) -> Child:
        """A router in front of `prefill_url` and the decode instances, speaking their protocol, ready."""
        argv = ["serve", "--role", "router", "--host", LOOPBACK, "--port", "0", "--prefill", prefill_url]
        argv += ["--pd-protocol", self.launcher.protocol, "--decode", *(d.url for d in self.decodes)]
        router = spawn(name, argv, self.stack.log_dir, self.env("router"))
        router.wait_ready(self.stack.ready_timeout_s)
        return router

    def stop_servers(self) -> dict[str, int]:
        """Each process's exit code (one that had exited already: none)."""
        codes: dict[str, int] = {}
        named = [("router", self.router), *((f"decode{i}", d) for i, d in enumerate(self.decodes))]
        for name, instance in (*named, ("prefill", self.prefill)):
            if instance is not None and (code := instance.stop(self.stack.stop_timeout_s)) is not None:
                codes[name] = code
        self.router, self.decodes, self.prefill = None, [], None
        return codes

    def bench(self, argv: list[str], timeout_s: float, url: str = "") -> subprocess.CompletedProcess:
        """`phaselens bench --url <router, or url> <argv>`, client spans to the collector (no clock skew)."""
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", url or self.router_url, *argv],
            env=self.stack.otel_env("phaselens-loadgen"),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise StackError(f"bench failed after {time.monotonic() - start:.0f} s:\n{done.stderr[-2000:]}")
        return done
