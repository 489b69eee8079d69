"""NVIDIA Dynamo on this machine (docs/other-servers.md#dynamo): its frontend and mocker workers on
loopback, tracing to a phaselens collector. Dynamo runs in its own virtualenv (./setup.sh --dynamo);
nothing here imports it."""
