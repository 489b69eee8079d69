"""vLLM prefill and decode instances for a disaggregated stack (`phaselens/pd_stack.py`;
docs/vllm.md#disaggregated-prefill-and-decode).

Each instance is vLLM with the phaselens plugin and its delivery middleware, tagged with its role
and URL, and the KV connector `Phaselens<KV_CONNECTOR>` (`kv_connector.py`: vLLM's connector,
timed per request) on a shared storage folder: vLLM's ExampleConnector, which needs no GPU, saves
each prompt's KV per layer into the folder on the prefill instance and loads it on the decode one.
ExampleConnector moves whole KV blocks only, so a prompt shorter than one block moves none: the
instances run with BLOCK_SIZE-token blocks (vLLM's CPU default is 128).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phaselens.instrumentation import names

from .http_request import MIDDLEWARE_PATH
from .launcher import DEFAULT_MODEL_NAME, VllmServer

KV_CONNECTOR = "ExampleConnector"
KV_CONNECTOR_MODULE = "phaselens.integrations.vllm.kv_connector"
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
MAX_MODEL_LEN = 2048


def kv_transfer_config(storage: Path, connector: str = KV_CONNECTOR) -> str:
    """vLLM's --kv-transfer-config for `connector`, timed, with its storage folder."""
    return json.dumps(
        {
            "kv_connector": f"Phaselens{connector}",
            "kv_connector_module_path": KV_CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    )


@dataclass(slots=True)
class VllmInstances:
    """What `PdStack` launches for `--pd-protocol vllm`: one vLLM per role, spawned, not yet ready."""

    python: Path
    model_dir: Path
    kv_dir: Path
    served_name: str = DEFAULT_MODEL_NAME
    max_model_len: int = MAX_MODEL_LEN
    protocol: str = names.PD_PROTOCOL_VLLM

    def launch(self, role: str, name: str, log_dir: Path, env: dict[str, str]) -> VllmServer:
        """`env`: the stack's environment for the role; vLLM takes its OTEL_* and a clock skew's
        LD_PRELOAD and FAKETIME* (not the span builder's setting: the plugin's own default holds)."""
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        ours = {k: v for k, v in env.items() if k.startswith(("OTEL_", "FAKETIME")) or k == "LD_PRELOAD"}
        flags = ("--kv-transfer-config", kv_transfer_config(self.kv_dir), "--block-size", str(BLOCK_SIZE))
        server = VllmServer(
            self.python,
            self.model_dir,
            log_dir / f"{name}.log",
            otlp_endpoint=env["OTEL_EXPORTER_OTLP_ENDPOINT"],
            env={**ours, "VLLM_PLUGINS": "phaselens"},
            served_name=self.served_name,
            max_model_len=self.max_model_len,
            middleware=(MIDDLEWARE_PATH,),
            extra_args=flags,
            pd_role=role,
        )
        server.spawn()
        return server
