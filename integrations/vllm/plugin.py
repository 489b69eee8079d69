"""The vLLM general plugin (entry point `vllm.general_plugins: phaselens`)."""


def register() -> None:
    """Called by vLLM in each of its processes."""
