"""KV blocks: allocation, reference counts and the prefix cache of full blocks.

A block holds `block_size` consecutive tokens of one sequence. A full block whose KV is computed
gets a chain hash `h_i = hash((h_{i-1}, tokens_i))`, so equal hashes mean equal prefixes; another
sequence whose prompt starts with the same full blocks shares them (ref count + 1) instead of
recomputing them. A freed block keeps its hash until it is handed out again (LRU: the free list
is ordered, freed tail blocks first), so a finished request still serves later hits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from phaselens.reference_server.engine.sequence import Sequence

NO_HASH = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # chain hash → block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, seq: Sequence, reserve: int = 0) -> bool:
        """Enough free blocks for the whole prefill (shared prefix hits cost nothing), keeping
        `reserve` blocks free for the running decodes."""
        hits = self._match_prefix(seq)
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_for(seq.num_tokens) - shared + reserve <= len(self._free)

    def admit(self, seq: Sequence) -> int:
        """Give `seq` blocks for all its known tokens; returns the tokens served by the prefix cache."""
        hits = self._match_prefix(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits + [self._allocate() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.num_hashed_blocks = len(hits)
        return len(hits) * self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Fresh blocks for `num_tokens` whose KV arrives from elsewhere (a disaggregated prefill);
        the caller checked `num_free`."""
        seq.block_table = [self._allocate() for _ in range(self.blocks_for(num_tokens))]
        seq.num_hashed_blocks = 0

    def can_append(self, seq: Sequence) -> bool:
        return self._has_slot(seq) or bool(self._free)

    def append(self, seq: Sequence) -> None:
        """Make room for the token a decode step feeds (position num_tokens − 1)."""
        if not self._has_slot(seq):
            seq.block_table.append(self._allocate())

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that became full and computed this step to the prefix cache."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block.hash = self._chain_hash(seq, i, tokens)
            block.token_ids = tokens
            self._cached.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def _chain_hash(self, seq: Sequence, index: int, tokens: tuple[int, ...]) -> int:
        parent = self.blocks[seq.block_table[index - 1]].hash if index else NO_HASH
        return hash((parent, tokens))

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Leading full blocks already cached; at least one token is always left to compute,
        because the step must produce logits for it."""
        hits: list[int] = []
        parent = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash((parent, tokens))
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def _has_slot(self, seq: Sequence) -> bool:
        return seq.num_tokens <= len(seq.block_table) * self.block_size

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _allocate(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block_id
