"""The model folder Dynamo's mocker serves: the tiny Llama's config and tokenizer, no weights (the
mocker simulates the engine; it reads the config for the KV cache's size and the tokenizer for
prompts and outputs).

The mocker draws output token ids from MOCKER_TOKEN_IDS (dynamo 1.6.1, mocker's random token
choice), beyond the tiny byte-level vocabulary: the tokenizer gains one word per id up to the
range's end, so every id the mocker emits decodes to visible text (` w1234`).
"""

from __future__ import annotations

from pathlib import Path

from phaselens.integrations.vllm.tiny_model import tiny_config, tiny_tokenizer

MOCKER_TOKEN_IDS = range(1000, 2001)
MODEL_NAME = "tiny"


def save_mocker_model(folder: Path, max_positions: int = 2048) -> Path:
    """Write config.json and the extended tokenizer into `folder` (~1 s)."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    # `Ġ` is the byte-level alphabet's space: the word decodes with a leading space
    tokenizer.add_tokens([f"Ġw{i}" for i in range(len(tokenizer), MOCKER_TOKEN_IDS.stop)])
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, max_positions)
    config.architectures = ["LlamaForCausalLM"]  # Dynamo's model card refuses a config without it
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
