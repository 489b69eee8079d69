"""The reference serving loop that phaselens instruments.

`schedule() → run() → postprocess()` continuous batching over a paged KV cache, chunked prefill,
prefix caching, preemption by recompute, and an OpenAI-compatible FastAPI front end.

    engine = Engine(EngineConfig(model="tiny"))      # builds the model runner, starts nothing
    engine.start()                                   # the loop thread
    seq = engine.submit(prompt_ids, SamplingParams(max_tokens=16), sink=print)
    engine.stop()
"""

import importlib

# Resolved on first use (PEP 562): `phaselens serve --help` and every other subcommand import
# `phaselens.reference_server.engine.config` without paying for torch and transformers.
_EXPORTS = {
    "Engine": "phaselens.reference_server.engine.engine",
    "QueueFullError": "phaselens.reference_server.engine.engine",
    "EngineConfig": "phaselens.reference_server.engine.config",
    "SamplingParams": "phaselens.reference_server.engine.sequence",
    "SeqOutput": "phaselens.reference_server.engine.sequence",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'reference_server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
