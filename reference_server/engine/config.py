"""Engine configuration: one slotted dataclass, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

POLICY_MIXED = "mixed"
POLICY_PREFILL_FIRST = "prefill-first"
POLICIES = (POLICY_MIXED, POLICY_PREFILL_FIRST)
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


@dataclass(slots=True)
class EngineConfig:
    """Knobs of the serving loop.

    `kv_cache_tokens` is the KV pool size in tokens (rounded down to whole blocks); the longest
    sequence the engine accepts is `max_model_len = min(model context, kv_cache_tokens)`, so a single
    sequence always fits and preemption by recompute always makes progress.
    """

    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_tokens: int = 65536
    block_size: int = 16
    policy: str = POLICY_MIXED
    max_waiting: int = 1024
    seed: int = 0
    cpu_threads: int = 0  # torch intra-op threads on cpu; 0 = auto (1 for tiny, torch's default otherwise)
    fault_token_id: int = -1  # tests only, no flag: a forward whose new tokens hold this id raises

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if self.fault_token_id < -1:
            raise ValueError(f"fault_token_id must be >= -1 (-1: off), got {self.fault_token_id}")
        positive = ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size", "max_waiting")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size
