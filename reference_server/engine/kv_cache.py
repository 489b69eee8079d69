"""The paged KV pool and the attention function that reads it, plugged into transformers.

transformers' attention layers call `cache.update(k, v, layer_idx)` and then the attention function
registered under `config._attn_implementation`. We register `phaselens_paged` and pass a
`PagedKVCache`, so an unmodified causal LM runs one *packed* forward for a mixed batch:

- all new tokens of the step (prefill chunks and decodes) are one row `[1, N]` with their own
  `position_ids`; linear layers see N tokens, no padding;
- `update()` writes the new K/V in place at their slots (`slot = block_id · block_size + offset`)
  of a pool preallocated per layer as `[kv_heads, num_blocks + 1, block_size, head_dim]`;
  nothing grows and nothing is copied back (no `torch.cat`); the last block is zero padding;
- attention gathers only the blocks of the batch's own sequences, once per layer, straight into
  the layout the matmuls want: decodes of similar length together as `[kv_heads, B, L, head_dim]` (grouped-query
  attention without repeating K/V), each prefill chunk as causal SDPA against its context.

Without a layout (e.g. inside `model.generate()`), the function falls back to plain SDPA, so the
same model object still works for the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "phaselens_paged"
LAYOUT_KWARG = "paged_layout"


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: queries `[q_start, q_end)` of the packed row attend to the keys at `slots`."""

    q_start: int
    q_end: int
    blocks: torch.Tensor  # [m] blocks holding positions 0 … ctx_len − 1
    ctx_len: int
    mask: torch.Tensor  # [T, ctx_len] bool, True = attend (key position ≤ query position)


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, padded to the longest of them."""

    rows: torch.Tensor  # [B] packed index of each decode token
    blocks: torch.Tensor  # [B·M] block tables, padded with the zero block
    bias: torch.Tensor  # [B, 1, M·block_size] 0 where attended, −inf on padding


@dataclass(slots=True)
class StepLayout:
    """Where the step's tokens go and what each attends to; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [N] slot of each new token
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedKVCache(Cache):
    """Preallocated per-layer K/V pools; `layout` is set by the model runner before each forward."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (kv_heads, num_blocks + 1, block_size, head_dim)
        self.layers = []  # transformers' per-layer cache objects: the pools below replace them
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pad_block = num_blocks
        self.layout: StepLayout | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's K/V `[1, kv_heads, N, head_dim]` at their slots; return the layer's pools."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots = self.layout.slot_mapping
        keys.flatten(1, 2).index_copy_(1, slots, key_states[0])
        values.flatten(1, 2).index_copy_(1, slots, value_states[0])
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def block_shape(self) -> tuple[int, ...]:
        """`[kv_heads, block_size, head_dim]` of one block of one layer's K (or V)."""
        shape = self.keys[0].shape
        return (shape[0], shape[2], shape[3])

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The K and V of `block_ids`, per layer K then V, each `[kv_heads, n, block_size, head_dim]`
        contiguous: the bytes a disaggregated prefill instance sends (disagg.kv_transfer)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        parts: list[bytes] = []
        for pool in (p for layer in zip(self.keys, self.values, strict=True) for p in layer):
            parts.append(pool.index_select(1, index).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return parts

    def import_blocks(self, block_ids: list[int], parts: list[bytes]) -> None:
        """Write what `export_blocks` produced (same model, same block size) into `block_ids`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        pools = [p for layer in zip(self.keys, self.values, strict=True) for p in layer]
        if len(parts) != len(pools):
            raise ValueError(f"KV payload has {len(parts)} tensors, this model needs {len(pools)}")
        for pool, raw in zip(pools, parts, strict=True):
            shape = (pool.shape[0], len(block_ids), pool.shape[2], pool.shape[3])
            src = torch.frombuffer(bytearray(raw), dtype=pool.dtype).view(shape)
            pool.index_copy_(1, index, src.to(pool.device))

    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        kv_heads, block_size, head_dim = self.block_shape
        return 2 * len(self.keys) * kv_heads * block_size * head_dim * self.keys[0].element_size()


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: DecodeGroup, scaling: float
) -> torch.Tensor:
    """q `[H, B, D]` → `[B, H, D]`; softmax(q·Kᵀ·scale + bias)·V per KV-head group:

    K, V gathered as `[kv_heads, B, L, D]`; q viewed as `[kv_heads, B, G, D]`, G = H / kv_heads."""
    kv_heads, batch = keys.shape[0], q.shape[1]
    k = keys.index_select(1, group.blocks).view(kv_heads, batch, -1, keys.shape[-1])
    v = values.index_select(1, group.blocks).view(kv_heads, batch, -1, values.shape[-1])
    qg = q.view(kv_heads, -1, batch, q.shape[-1]).transpose(1, 2)  # [kv_heads, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scaling + group.bias
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [kv_heads, B, G, D]
    return out.transpose(1, 2).reshape(q.shape[0], batch, -1).transpose(0, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query `[1, H, N, D]`; key/value: the layer's pools. Returns `([1, N, H, D], None)`."""
    layout: StepLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    q = query[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    for group in layout.decodes:
        out[group.rows] = _decode_attention(q[:, group.rows], key, value, group, scale)
    for span in layout.prefills:
        qp = q[:, span.q_start : span.q_end].unsqueeze(0)
        kp = key.index_select(1, span.blocks).flatten(1, 2)[None, :, : span.ctx_len]
        vp = value.index_select(1, span.blocks).flatten(1, 2)[None, :, : span.ctx_len]
        op = scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[span.q_start : span.q_end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
