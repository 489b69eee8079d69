"""The reference serving loop that phaselens instruments.

`schedule() → run() → postprocess()` continuous batching over a paged KV cache, chunked prefill,
prefix caching, preemption by recompute, and an OpenAI-compatible FastAPI front end.

    engine = Engine(EngineConfig(model="tiny"))      # builds the model runner, starts nothing
    engine.start()                                   # the loop thread
    seq = engine.submit(prompt_ids, SamplingParams(max_tokens=16), sink=print)
    engine.stop()
"""

from reference_server.config import EngineConfig
from reference_server.engine import Engine, QueueFullError
from reference_server.sequence import SamplingParams, SeqOutput

__all__ = ["Engine", "EngineConfig", "QueueFullError", "SamplingParams", "SeqOutput"]
