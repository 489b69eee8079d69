"""phaselens inside vLLM (docs/vllm.md): a launcher for a real vLLM on a tiny offline model, and the
vLLM plugin that gives every request phaselens's span tree. Only this subpackage imports vLLM."""
