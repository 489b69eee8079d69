"""Start and stop NVIDIA Dynamo on loopback: its Rust frontend (`python -m dynamo.frontend`) and mocker
workers (`python -m dynamo.mocker`), aggregated (one worker) or disaggregated (one prefill worker,
one decode worker), tracing to an OTLP/gRPC endpoint (docs/other-servers.md#dynamo).

Dynamo runs in its own virtualenv; no etcd, no NATS: file discovery in `state_dir`, TCP request
plane, ZMQ event plane. Every plane is told to bind and advertise loopback (without the `*_HOST`
variables Dynamo uses the machine's other interface); its ZMQ PUB sockets bind 0.0.0.0 whatever
they are told (docs/other-servers.md#dynamo).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.common.process import LOOPBACK, die_with_parent, free_port, on_fresh_ports, terminate
from phaselens.integrations.dynamo.model_dir import MODEL_NAME, save_mocker_model

VENV_ENV = "PHASELENS_DYNAMO_PYTHON"  # a python with ai-dynamo; default: ./.venv-dynamo/bin/python
FRONTEND_SERVICE = "dynamo-frontend"
# the mocker's simulated transfer: GB/s over the KV bytes of the tiny model's config
KV_TRANSFER_GBPS = 1.0
BIND_FAILED = "Address already in use"


def default_python(root: Path = Path(".")) -> Path | None:
    """$PHASELENS_DYNAMO_PYTHON, else `root`/.venv-dynamo/bin/python; None when neither exists."""
    path = Path(os.environ[VENV_ENV]) if os.environ.get(VENV_ENV) else Path(root) / ".venv-dynamo/bin/python"
    return path if path.exists() else None


class DynamoError(RuntimeError):
    pass


@dataclass(slots=True)
class DynamoProcess:
    """One Dynamo process in a session of its own, dying with us, its output appended to `log_path`."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def spawn(cls, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> DynamoProcess:
        parent = os.getpid()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent),
            )
        return cls(name, proc, log_path)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        return terminate(self.proc, timeout_s)


def dynamo_env(state_dir: Path, otlp_endpoint: str, service: str) -> dict[str, str]:
    """Every plane on loopback, discovery in files, spans and logs to `otlp_endpoint`."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(state_dir / "kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
        "DYN_EVENT_PLANE_HOST": LOOPBACK,
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_LOGGING_JSONL": "true",
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(state_dir / "cache"),  # the model cards Dynamo copies, not ~/.cache
        "OTEL_EXPORT_ENABLED": "true",
        # logs too (else they go to the default port 4317, whoever listens there)
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_endpoint,
        "OTEL_SERVICE_NAME": service,
    }


@dataclass(slots=True)
class DynamoDeployment:
    """A frontend and its mocker workers, each a child in a session of its own, logging to `log_dir`."""

    python: Path
    state_dir: Path  # model folder and file discovery, made at run time
    log_dir: Path
    otlp_endpoint: str
    disagg: bool = False
    port: int = 0
    frontend: DynamoProcess | None = field(default=None, init=False)
    workers: dict[str, DynamoProcess] = field(default_factory=dict, init=False)  # service name → worker

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def roles(self) -> dict[str, str]:
        """Worker service name → --disaggregation-mode (one name per worker: the budget's instance)."""
        if self.disagg:
            return {"dynamo-worker-prefill": "prefill", "dynamo-worker-decode": "decode"}
        return {"dynamo-worker": "agg"}

    def start(self, timeout_s: float = 120.0) -> Self:
        """Workers, then the frontend; ready when /v1/models lists the model (2–25 s after launch).
        A frontend port taken before it bound is retried on a fresh one."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        model = save_mocker_model(self.state_dir / "model")
        try:
            for service, mode in self.roles().items():
                argv = ["-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL_NAME]
                argv += ["--disaggregation-mode", mode, "--kv-transfer-bandwidth", str(KV_TRANSFER_GBPS)]
                self.workers[service] = self._spawn(service, argv)
            on_fresh_ports(lambda: self._start_frontend(timeout_s), self._lost_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, service: str, argv: list[str]) -> DynamoProcess:
        env = dynamo_env(self.state_dir, self.otlp_endpoint, service)
        return DynamoProcess.spawn(service, [str(self.python), *argv], self.log_dir / f"{service}.log", env)

    def _start_frontend(self, timeout_s: float) -> None:
        self.port = free_port()
        argv = ["-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(self.port)]
        self.frontend = self._spawn(FRONTEND_SERVICE, argv)
        self.wait_ready(timeout_s)

    def _lost_port(self, exc: BaseException) -> bool:
        front = self.frontend
        if front is None or front.proc.poll() is None:
            return False
        return isinstance(exc, DynamoError) and BIND_FAILED in front.log_tail(20000)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /v1/models until it lists the model; any child exiting first is an error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for child in (self.frontend, *self.workers.values()):
                if child is not None and child.proc.poll() is not None:
                    raise DynamoError(f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            if MODEL_NAME in self._models():
                return
            time.sleep(0.5)
        raise DynamoError(f"Dynamo's frontend did not list {MODEL_NAME!r} after {timeout_s:.0f} s")

    def _models(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                return [m["id"] for m in json.load(response).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError):
            return []

    def pids(self) -> list[int]:
        return [c.proc.pid for c in (self.frontend, *self.workers.values()) if c is not None]

    def stop(self, timeout_s: float = 15.0) -> dict[str, int]:
        """Frontend first (it flushes its spans), then the workers; exit codes by name."""
        codes = {}
        for child in (self.frontend, *self.workers.values()):
            if child is not None:
                codes[child.name] = child.stop(timeout_s)
        self.frontend, self.workers = None, {}
        return codes

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def python_or_error() -> Path:
    """The Dynamo python, or a DynamoError saying how to get one."""
    python = default_python()
    if python is None:
        raise DynamoError(f"no Dynamo found: run ./setup.sh --dynamo, or set {VENV_ENV} to a python with ai-dynamo")
    return python
