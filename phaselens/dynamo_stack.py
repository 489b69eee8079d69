"""NVIDIA Dynamo on one machine behind the stack's pipeline: ClickHouse, schema and collector, then
Dynamo's frontend and mocker workers (aggregated, or one prefill + one decode worker) tracing to the
collector (phaselens.integrations.dynamo.launcher). Dynamo's model folder and discovery files live
under the data directory's `dynamo/`, made at run time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.integrations.dynamo.launcher import DynamoDeployment, python_or_error
from phaselens.stack import ServedStack


@dataclass(slots=True)
class DynamoStack(ServedStack):
    disagg: bool = False
    deployment: DynamoDeployment | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return self.deployment.url if self.deployment else ""

    def start_servers(self, on_phase=lambda phase: None) -> Self:
        on_phase("Dynamo's frontend and workers")
        self.deployment = DynamoDeployment(
            python_or_error(),
            Path(self.stack.data_dir) / "dynamo",
            self.stack.log_dir,
            self.stack.otlp_grpc_endpoint,
            disagg=self.disagg,
        )
        self.deployment.start(self.stack.ready_timeout_s)
        return self

    def stop_servers(self) -> dict[str, int]:
        codes = self.deployment.stop(self.stack.stop_timeout_s) if self.deployment else {}
        self.deployment = None
        return codes
