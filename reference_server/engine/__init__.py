"""The engine: the serving loop (`schedule() → run() → postprocess()`), its scheduler, paged KV cache,
model runner, sampler and detokenizer, and its side of disaggregated serving (the KV hand-off and
its TCP wire). It knows nothing of HTTP."""
