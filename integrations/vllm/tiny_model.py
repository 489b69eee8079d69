"""A tiny random Llama saved for vLLM, built offline: no download, ~2 MB, ready in ~1 s.

vLLM loads a model directory as `save_pretrained` writes it, and needs a *fast* tokenizer
(`tokenizer.json`) and, for `/v1/chat/completions`, a chat template. The tokenizer is byte-level
BPE trained on a few English words, so an English word is a few tokens; `phaselens bench
--tokenizer DIR` counts prompts in exactly these tokens.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = [
    "the",
    "time",
    "to",
    "first",
    "token",
    "is",
    "queue",
    "prefill",
    "decode",
    "delivery",
    "network",
    "of",
    "a",
    "request",
    "and",
    "server",
    "client",
    "span",
    "trace",
    "budget",
    "latency",
    "model",
    "batch",
    "step",
    "cache",
]
EOS = "</s>"


def _tokenizer(vocab_size: int):
    """Byte-level BPE: any text encodes, so no prompt is rejected for unknown characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(_WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, bos_token_id: int, eos_token_id: int, max_positions: int = 2048):
    """The tiny Llama's shape: 2 layers, hidden 128, head dim 64 (vLLM's CPU attention has no kernel
    for head dims below 32). Dynamo's mocker reads it for the KV cache's size (integrations/dynamo)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )


def tiny_tokenizer():
    """The tiny model's tokenizer, as save_tiny_llama writes it."""
    return _tokenizer(vocab_size=384)


def save_tiny_llama(folder: Path, max_positions: int = 2048, seed: int = 0) -> Path:
    """Write a random LlamaForCausalLM of `tiny_config` and its tokenizer into `folder`."""
    import torch
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, max_positions)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
