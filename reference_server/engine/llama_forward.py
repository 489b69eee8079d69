"""A lean forward for a Llama-architecture model over the paged cache: the ops of transformers'
`LlamaForCausalLM.forward`, value for value, without its per-module Python.

On a small model the step's time is Python, not arithmetic: transformers runs each layer through
module hooks, decorators, kwargs plumbing, a causal-mask builder and a rotary module per forward
(the saved tiny Llama: ~1.4 ms per 8-token decode step, most of it outside the kernels). Here one
loop over the layers' weight tensors does

    h = embed[ids]
    per layer: x = rms(h)·w_in;  q, k, v = x·W_qᵀ, x·W_kᵀ, x·W_vᵀ
               q, k = q·cos + rot(q)·sin, k·cos + rot(k)·sin   (cos/sin rows of a table)
               K/V written at their slots; h += attn(q, K, V)·W_oᵀ
               x = rms(h)·w_post;  h += (silu(x·W_gateᵀ)·(x·W_upᵀ))·W_downᵀ
    logits = rms(h[keep])·w_norm · W_headᵀ
    rms(x) = x · rsqrt(mean(x²) + ε), in float32

The matmuls stay one per weight, as transformers has them: stacking q/k/v (or gate/up) into one
matmul changes a one-row step's result in the last bits (MKL's matrix-vector kernel reduces in an
order that depends on the row count). The rotary table holds what transformers' rotary module
computes per position, so the logits are bitwise the same (tests/test_engine.py checks it against
the model's own forward).
Models this does not cover (another class, biases, a rope that changes with length) keep the
transformers forward: `LlamaForward.for_model` returns None for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import embedding, linear, silu

from phaselens.reference_server.engine.kv_cache import LAYOUT_KWARG, PagedKVCache, StepLayout, paged_attention

STATIC_ROPE = ("default", "linear", "llama3")  # cos/sin depend on the position alone


@dataclass(slots=True)
class LayerWeights:
    w_in: torch.Tensor  # input_layernorm
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    w_post: torch.Tensor  # post_attention_layernorm
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass(slots=True)
class LlamaForward:
    layers: list[LayerWeights]
    embed: torch.Tensor
    w_norm: torch.Tensor
    head: torch.Tensor
    cos: torch.Tensor  # [positions, D], in the model's dtype
    sin: torch.Tensor
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float

    @classmethod
    def for_model(cls, model: Any, max_positions: int) -> LlamaForward | None:
        """The lean forward of `model`, or None when it is not a plain Llama (module docstring)."""
        from transformers import LlamaForCausalLM

        cfg = model.config
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        plain = not (cfg.attention_bias or cfg.mlp_bias) and cfg.hidden_act == "silu"
        if type(model) is not LlamaForCausalLM or not plain or rope not in STATIC_ROPE:
            return None
        inner = model.model
        attn0 = inner.layers[0].self_attn
        cos, sin = rotary_table(inner.rotary_emb, max_positions, inner.embed_tokens.weight)
        return cls(
            layers=[layer_weights(layer) for layer in inner.layers],
            embed=inner.embed_tokens.weight,
            w_norm=inner.norm.weight,
            head=model.lm_head.weight,
            cos=cos,
            sin=sin,
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=attn0.head_dim,
            eps=inner.norm.variance_epsilon,
            scaling=attn0.scaling,
        )

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, cache: PagedKVCache, layout: StepLayout
    ) -> torch.Tensor:
        """ids, positions `[N]`; returns the logits of the `keep` rows, `[B, vocab]`."""
        n, d = ids.shape[0], self.head_dim
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # [1, N, D] against [H, N, D]
        h = embedding(ids, self.embed)
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.w_in, self.eps)
            q = linear(x, layer.q).view(n, self.q_heads, d).transpose(0, 1)
            k = linear(x, layer.k).view(n, self.kv_heads, d).transpose(0, 1)
            q = (q * cos) + (rotate_half(q) * sin)
            k = (k * cos) + (rotate_half(k) * sin)
            keys, values = cache.keys[index], cache.values[index]
            keys.flatten(1, 2).index_copy_(1, layout.slot_mapping, k)
            values.flatten(1, 2).index_copy_(
                1, layout.slot_mapping, linear(x, layer.v).view(n, self.kv_heads, d).transpose(0, 1)
            )
            out, _ = paged_attention(None, q[None], keys, values, None, scaling=self.scaling, **{LAYOUT_KWARG: layout})
            h = h + linear(out.view(n, self.q_heads * d), layer.o)
            x = rms_norm(h, layer.w_post, self.eps)
            h = h + linear(silu(linear(x, layer.gate)) * linear(x, layer.up), layer.down)
        return linear(rms_norm(h[keep], self.w_norm, self.eps), self.head)


def layer_weights(layer: Any) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        w_in=layer.input_layernorm.weight,
        q=attn.q_proj.weight,
        k=attn.k_proj.weight,
        v=attn.v_proj.weight,
        o=attn.o_proj.weight,
        w_post=layer.post_attention_layernorm.weight,
        gate=mlp.gate_proj.weight,
        up=mlp.up_proj.weight,
        down=mlp.down_proj.weight,
    )


def rotary_table(rotary: Any, max_positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[max_positions, D]` from the model's own rotary module (elementwise per position,
    so a row is what the module gives for that position in any batch)."""
    with torch.inference_mode():
        positions = torch.arange(max_positions, device=like.device)[None]
        cos, sin = rotary(like[:1][None], positions)
    return cos[0], sin[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: in float32, back to the input's dtype, then the weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
