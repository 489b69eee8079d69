"""OpenAI response and stream-chunk bodies (completions and chat), built from engine outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from phaselens.reference_server.engine.sequence import SeqOutput
from phaselens.reference_server.serving.sse import TextEvent, encode_event


@dataclass(slots=True)
class Envelope:
    """What every body of one response shares."""

    request_id: str
    model: str
    chat: bool
    prompt_tokens: int
    created: int = 0
    content_event: TextEvent = field(init=False)  # a content-only chunk's event, encoded per token

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.content_event = TextEvent.of(lambda text: self.chunk(content=text))

    def delta_event(self, reasoning: str, content: str) -> bytes:
        """The SSE event of one delta: `encode_event(self.chunk(reasoning, content))`, pre-encoded
        when it carries content alone (every token of a model without reasoning)."""
        if reasoning or not content:
            return encode_event(self.chunk(reasoning, content))
        return self.content_event(content)

    def _base(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, final: SeqOutput) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": final.output_tokens,
            "total_tokens": self.prompt_tokens + final.output_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
        }

    def chunk(
        self, reasoning: str = "", content: str = "", finish_reason: str | None = None, role: bool = False
    ) -> dict:
        """One stream chunk; the first chat chunk carries only the role (and empty content)."""
        if not self.chat:
            body = self._base("text_completion")
            body["choices"] = [{"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}]
            return body
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        body = self._base("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return body

    def usage_chunk(self, final: SeqOutput) -> dict:
        body = self._base("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(final)
        return body

    def full(self, reasoning: str, content: str, final: SeqOutput) -> dict:
        """The non-streaming response."""
        if self.chat:
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": final.finish_reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": final.finish_reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        body["usage"] = self.usage(final)
        return body
