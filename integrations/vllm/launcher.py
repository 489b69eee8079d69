"""Start and stop a real vLLM server on loopback (no vLLM import here: it runs in vLLM's own
virtualenv, `python -m phaselens.integrations.vllm.serve`).

    with VllmServer(python, model_dir, otlp_endpoint=...) as server:
        server.url  # http://127.0.0.1:PORT, /health answered

Settings that make vLLM start on a small CPU machine in ~40 s (docs/vllm.md): 1 GiB KV cache,
float32, eager mode, loopback only, no usage statistics, no download; spans leave vLLM's batch
processor after `bsp_delay_ms` instead of the SDK's 5 s.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.common.process import LOOPBACK, free_port, on_fresh_ports
from phaselens.instrumentation.pipeline import tag_pd_resource

# vLLM binds its port before it loads the model (vllm.entrypoints.launchers.launcher.setup_server):
# a port taken since it was picked ends that run within seconds, the OSError's text in its log.
BIND_FAILED = "Address already in use"
VENV_ENV = "PHASELENS_VLLM_PYTHON"  # a python with vLLM installed; default: ./.venv-vllm/bin/python
DEFAULT_MODEL_NAME = "tiny"
TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # read by vLLM's exporter and the plugin's span-builder child
PROTOCOL_GRPC, PROTOCOL_HTTP = "grpc", "http/protobuf"


def default_python(root: Path = Path(".")) -> Path | None:
    """A python with vLLM: $PHASELENS_VLLM_PYTHON, else `root`/.venv-vllm/bin/python, else this one
    when vLLM is installed beside phaselens (`pip install 'phaselens[vllm]'`)."""
    path = Path(os.environ[VENV_ENV]) if os.environ.get(VENV_ENV) else Path(root) / ".venv-vllm/bin/python"
    if path.exists():
        return path
    return Path(sys.executable) if importlib.util.find_spec("vllm") is not None else None


def trace_export(grpc_endpoint: str, http_traces_endpoint: str, plugin: bool) -> tuple[str, str]:
    """`VllmServer`'s (`otlp_endpoint`, `otlp_protocol`) for a collector that takes both protocols:
    with the plugin OTLP/HTTP, so its span-builder child exports as the reference server's does
    (`http_transport`: no grpcio threads, docs/vllm.md#cost); vLLM's own spans over gRPC, its default."""
    return (http_traces_endpoint, PROTOCOL_HTTP) if plugin else (grpc_endpoint, PROTOCOL_GRPC)


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": LOOPBACK,
        "VLLM_LOOPBACK_IP": LOOPBACK,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "PHASELENS_PARENT_PID": str(os.getpid()),
    }
    return {**env, **(extra or {})}


@dataclass(slots=True)
class VllmServer:
    """One `vllm serve` child in a session of its own (its EngineCore and workers die with it)."""

    python: Path
    model_dir: Path
    log_path: Path
    otlp_endpoint: str | None = None  # vLLM's --otlp-traces-endpoint
    otlp_protocol: str = (
        PROTOCOL_GRPC  # its protocol (vLLM's and the plugin's exporters): PROTOCOL_HTTP for a URL ending /v1/traces
    )
    env: dict[str, str] = field(default_factory=dict)
    served_name: str = DEFAULT_MODEL_NAME
    max_model_len: int = 512
    bsp_delay_ms: int = 100
    middleware: tuple[str, ...] = ()  # vLLM's --middleware, each an ASGI middleware's import path
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags (e.g. --kv-transfer-config)
    pd_role: str = ""  # prefill | decode: its spans tagged with the role and its URL (docs/disaggregation.md)
    port: int = 0
    proc: subprocess.Popen | None = None
    log_offset: int = 0  # where this run's output starts in the log

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def argv(self) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "phaselens.integrations.vllm.serve",
            str(self.model_dir),
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_name,
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
        ]
        if self.otlp_endpoint:
            args += ["--otlp-traces-endpoint", self.otlp_endpoint]
        for path in self.middleware:
            args += ["--middleware", path]
        return [*args, *self.extra_args]

    def start(self, timeout_s: float = 240.0) -> VllmServer:
        """Spawn and wait for /health. vLLM's `--port` must be known before it starts, so a port left
        at 0 is picked here, free when picked; another process may bind it before vLLM does, which
        then exits saying so: such a start is retried on a fresh port (`BIND_ATTEMPTS` in all)."""
        picked = self.port == 0

        def run() -> VllmServer:
            if picked:
                self.port = 0  # spawn() picks a fresh one
            self.spawn()
            self.wait_ready(timeout_s)
            return self

        return on_fresh_ports(run, lambda exc: picked and isinstance(exc, RuntimeError) and self.lost_port())

    def spawn(self) -> None:
        self.port = self.port or free_port()
        env = vllm_env(
            {"OTEL_BSP_SCHEDULE_DELAY": str(self.bsp_delay_ms), TRACES_PROTOCOL: self.otlp_protocol, **self.env}
        )
        if self.pd_role:  # known once the port is: a retry on a fresh port tags the new URL
            tag_pd_resource(env, self.pd_role, self.url)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> str:
        """Block until /health answers 200 (as `phaselens.stack.Child.wait_ready`); returns the url."""
        assert self.proc is not None  # spawned first
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def lost_port(self) -> bool:
        """This run exited because its port was bound by another process first."""
        return self.proc is not None and self.proc.poll() is not None and BIND_FAILED in self.run_output()

    def run_output(self) -> str:
        """This run's part of the log (a restart appends to it)."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to vLLM's process group (API server, EngineCore, workers), SIGKILL after `timeout_s`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
