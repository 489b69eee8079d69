"""Chat messages → prompt text.

A local model with a `chat_template` in its tokenizer uses it (`add_generation_prompt=True`).
Otherwise (the `tiny` model) this fixed template, one block per message, then the assistant cue:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n … <|assistant|>\\n
"""

from __future__ import annotations


def render_simple(messages: list[dict[str, str]]) -> str:
    blocks = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(blocks) + "<|assistant|>\n"


def render(messages: list[dict[str, str]], tokenizer: object) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_simple(messages)
