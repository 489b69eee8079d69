"""Load the causal LM and its tokenizer: the built-in `tiny` model or a local Hugging Face folder.

`tiny` is a random-initialised Llama (4 layers, hidden 128, GQA 4:2, context 4096) over the ByT5
byte tokenizer (vocabulary 384, no files needed), built from a fixed seed: the same weights in every
process. Its output vocabulary is restricted to printable ASCII, newline and EOS (`suppressed_ids`,
applied as −inf logits), so every generated token is exactly one visible character — streams,
TTFT and ITL then behave like a real model's. Give the same ids to `generate(suppress_tokens=…)`
to reproduce its greedy output.

A local folder loads with `local_files_only=True` (no hub access) through `AutoModelForCausalLM`;
the attention must follow transformers' AttentionInterface (Llama, Mistral, Qwen2/3, … do). The
process environment is left as it was: an `HF_HUB_OFFLINE=1` set here would reach every later child
(AIPerf 0.13 fails with it, docs/harness-import.md), and huggingface_hub reads it only at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from phaselens.reference_server.engine import kv_cache
from phaselens.reference_server.engine.detokenizer import BYTE_OFFSET, Decode, decode_bytes, tokenizer_decoder

TINY = "tiny"
TINY_VOCAB = 384
TINY_EOS = 1
_TINY_ALLOWED_BYTES = [10, *range(32, 127)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    decode: Decode  # output ids → text, special tokens skipped
    eos_ids: frozenset[int]
    max_context: int
    suppressed_ids: tuple[int, ...] = ()
    name: str = TINY
    add_special_tokens: bool = False  # ByT5 would append EOS to every prompt; HF models add BOS


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=TINY_EOS,
        tie_word_embeddings=False,
        initializer_range=0.2,  # wider than the usual 0.02: varied text instead of one repeated byte
    )


def tiny_suppressed_ids() -> tuple[int, ...]:
    allowed = {TINY_EOS, *(b + BYTE_OFFSET for b in _TINY_ALLOWED_BYTES)}
    return tuple(i for i in range(TINY_VOCAB) if i not in allowed)


def build_tiny(seed: int = 0, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """The built-in model: same seed, same weights; the global RNG is left untouched."""
    from transformers import ByT5Tokenizer, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config())
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    return LoadedModel(
        model=model,
        tokenizer=ByT5Tokenizer(),
        decode=decode_bytes,
        eos_ids=frozenset({TINY_EOS}),
        max_context=model.config.max_position_embeddings,
        suppressed_ids=tiny_suppressed_ids(),
    )


def load_local(path: str, dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    """A Hugging Face model folder on disk, opened offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"--model must be 'tiny' or a local model folder; {path!r} is not a folder")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    model = model.to(device).eval()
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = {*([eos] if isinstance(eos, int) else eos or []), tokenizer.eos_token_id} - {None}
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        decode=tokenizer_decoder(tokenizer),
        eos_ids=frozenset(eos_ids),
        max_context=getattr(model.config, "max_position_embeddings", 4096),
        name=model_name(path),
        add_special_tokens=True,
    )


def model_name(name: str) -> str:
    """The model's own name: `tiny`, or a local folder's base name."""
    return TINY if name == TINY else os.path.basename(os.path.normpath(name))


def load_tokenizer(name: str) -> tuple[object, bool, str]:
    """(tokenizer, add_special_tokens, model name) without the weights: the API process of an
    engine process (reference_server.process.engine_client) only tokenizes."""
    if name == TINY:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(), False, TINY
    from transformers import AutoTokenizer

    if not os.path.isdir(name):
        raise ValueError(f"--model must be 'tiny' or a local model folder; {name!r} is not a folder")
    return AutoTokenizer.from_pretrained(name, local_files_only=True), True, model_name(name)


def load(name: str, dtype: str, device: str, seed: int = 0) -> LoadedModel:
    """Load by `--model` value and switch its attention to the paged implementation."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to this process")
    loaded = build_tiny(seed, dtype, device) if name == TINY else load_local(name, dtype, device)
    loaded.model.set_attn_implementation(kv_cache.ATTN_IMPLEMENTATION)
    return loaded
