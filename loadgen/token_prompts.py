"""Prompts of an exact token count in a target's tokenizer (`phaselens bench --tokenizer`).

Without a tokenizer, `--input-len N` is N common English words, about N tokens for an English BPE
vocabulary and more for a small or byte-level one (the tiny model's: ~3 tokens a word). With one
(a local folder or a name in the Hugging Face cache; nothing is downloaded), a prompt is made from
words, encoded, cut to N token ids and decoded; because decoding then re-encoding can merge across
the cut, the cut moves until re-encoding gives exactly N (as `vllm bench serve` does for its
random prompts). N counts the prompt's own tokens: special tokens the server's tokenizer adds (a BOS)
are on top, and a chat template's tokens too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_ADJUST = 16  # cut positions tried before giving up on exactness


@dataclass(slots=True)
class TokenPrompts:
    tokenizer: Any
    name: str

    @classmethod
    def load(cls, name: str) -> TokenPrompts:
        """The tokenizer of a local folder or a cached model id (transformers, local files only)."""
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(name, local_files_only=True), name)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer {name}: not a local tokenizer folder or cached model ({exc})") from None

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, rng: np.random.Generator, n: int, words) -> str:
        """A text that this tokenizer encodes to exactly `n` tokens; `words(rng, k)` gives k words."""
        ids: list[int] = []
        while len(ids) < n + 1:
            ids += self.tokenizer.encode(" " + words(rng, max(8, n)), add_special_tokens=False)
        cut = n
        for _ in range(MAX_ADJUST):
            text = self.tokenizer.decode(ids[:cut])
            got = self.count(text)
            if got == n:
                return text
            cut += 1 if got < n else -1
        raise ValueError(f"--tokenizer {self.name}: no prompt of exactly {n} tokens found")
