"""OpenAI request bodies → validated engine parameters; OpenAI-shaped errors.

Only what the engine implements is accepted: `n` must be 1, `best_of`/`logprobs`/`echo`/`tools`
are refused with a 400 naming the parameter rather than silently ignored, and so are penalties and
`min_p` other than their neutral value (the sampler does not apply them). Unknown extra fields are
ignored, as OpenAI-compatible servers do.

Every numeric parameter is checked for type (a boolean or a string is not a number), then
finiteness, then range, in that order: NaN compares False with everything, so a range check alone
would let it through to the sampler. Integers must fit a signed 64-bit integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from phaselens.reference_server.engine.sequence import SamplingParams

MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant", "developer", "tool")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UNSUPPORTED = ("best_of", "echo", "logprobs", "top_logprobs", "tools", "functions", "suffix", "logit_bias")


class ApiError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


@dataclass(slots=True)
class ParsedRequest:
    """A request body, checked. `prompt` is text, or token ids; `messages` for chat. `sampling`
    still lacks max_tokens (None here means the default, which depends on the prompt length)."""

    model: str
    sampling: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field that gave max_tokens, for errors
    stream: bool = False
    include_usage: bool = False
    kv_transfer: dict[str, str] | None = None  # disaggregated serving: `kv_transfer_params` (docs/disaggregation.md)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    """Type, then finiteness, then range (see the module docstring)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{name} must be a number", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"{name} must be a finite number, got {value}", name)
    if value < low or value > high or (low_open and value == low):
        raise bad(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def _neutral(body: dict, name: str, neutral: float, low: float, high: float, low_open: bool = False) -> None:
    """A parameter the engine does not apply: checked like any number, then only its no-effect value passes."""
    if _number(body, name, neutral, low, high, low_open) != neutral:
        raise bad(f"{name} is not applied by this server: only {neutral} (no effect) is accepted", name)


def _integer(body: dict, name: str, low: int = INT64_MIN) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {value!r:.40}", name)
    if value < low:
        raise bad(f"{name} must be >= {low}, got {value}", name)
    if value > INT64_MAX:
        raise bad(f"{name} must fit a signed 64-bit integer (at most {INT64_MAX})", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name} must be a boolean", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return tuple(stops)


def _common(body: Any, max_tokens_key: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0):
            raise bad(f"{name} is not supported by this server", name)
    if _integer(body, "n") not in (None, 1):
        raise bad("only n=1 is supported", "n")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required", "model")
    stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    if options and not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    _neutral(body, "presence_penalty", 0.0, -2.0, 2.0)
    _neutral(body, "frequency_penalty", 0.0, -2.0, 2.0)
    _neutral(body, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True)
    _neutral(body, "min_p", 0.0, 0.0, 1.0)
    top_k = _integer(body, "top_k", low=-1)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k or 0, 0),  # -1 (vLLM) and 0 both mean off
        seed=_integer(body, "seed"),
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos"),
    )
    return ParsedRequest(
        model=model,
        sampling=sampling,
        max_tokens=_integer(body, max_tokens_key, low=1),
        stream=stream,
        include_usage=_boolean(options, "include_usage"),
        kv_transfer=_kv_transfer(body),
    )


def _kv_transfer(body: dict) -> dict[str, str] | None:
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise bad("kv_transfer_params must be an object of strings", "kv_transfer_params")
    return value


def parse_completion(body: Any) -> ParsedRequest:
    parsed = _common(body, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise bad("prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")
    parsed.prompt = prompt
    return parsed


def parse_chat(body: Any) -> ParsedRequest:
    parsed = _common(body, "max_completion_tokens")
    if parsed.max_tokens is None:
        parsed.max_tokens = _integer(body, "max_tokens", low=1)
    else:
        parsed.max_tokens_param = "max_completion_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    parsed.messages = [_message(m, i) for i, m in enumerate(messages)]
    return parsed


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad(f"{param} must be an object with role in {ROLES}", param)
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is understood
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string", f"{param}.content")
    return {"role": message["role"], "content": content}
