"""Workloads: what each request asks for (prompt or messages, output length), seeded.

Synthetic prompts are made of common English words, each about one token for English BPE tokenizers
(`--input-len` counts words; the server's `usage.prompt_tokens` reports the exact count), or, with a
tokenizer (`--tokenizer`, `token_prompts.py`), of exactly `--input-len` tokens of it. Output
length is held with `max_tokens`, plus `ignore_eos`/`min_tokens` (vLLM/SGLang extensions) when asked.
Length distributions, as strings:
    N | fixed:N           always N
    uniform:LO:HI        integers LO..HI inclusive
    normal:MEAN:STD      rounded, at least 1
    lognormal:MEAN:SIGMA mean MEAN, σ of the underlying normal SIGMA (μ = ln MEAN − σ²/2), at least 1
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from phaselens.loadgen.arrivals import TraceEntry
from phaselens.loadgen.token_prompts import TokenPrompts

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "this",
    "are",
    "were",
    "be",
    "had",
    "have",
    "not",
    "but",
    "which",
    "one",
    "all",
    "their",
    "they",
    "there",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
]
# UTF-8 bytes of one of _WORDS with its space, on average (≈ 4.8): a byte-level tokenizer's tokens per word
BYTES_PER_WORD = sum(len(word) + 1 for word in _WORDS) / len(_WORDS)


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A distribution of lengths (tokens or words); parse it from `fixed:N`, `uniform:LO:HI` …"""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                dist = cls("fixed", float(parts[-1]))
            elif parts[0] in ("uniform", "normal", "lognormal") and len(parts) == 3:
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length distribution {spec!r}: use N, fixed:N, uniform:LO:HI, "
                "normal:MEAN:STD or lognormal:MEAN:SIGMA"
            ) from None
        dist._check(spec)
        return dist

    def _check(self, spec: str) -> None:
        if self.a < 1 or self.b < 0 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"bad length distribution {spec!r}: lengths must be ≥ 1 (and LO ≤ HI)")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = int(rng.integers(int(self.a), int(self.b) + 1))
        elif self.kind == "normal":
            value = rng.normal(self.a, self.b)
        else:
            value = rng.lognormal(math.log(self.a) - self.b**2 / 2, self.b)
        return max(1, round(value))

    def __str__(self) -> str:
        return f"fixed:{self.a:g}" if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(slots=True)
class RequestSpec:
    """One request's content: `prompt` (text) or `messages` (chat), and its output length."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None

    def payload(self, endpoint: str, model: str, ignore_eos: bool = False, extra: dict | None = None) -> dict:
        """The JSON body for `/v1/completions` ("completions") or `/v1/chat/completions` ("chat")."""
        body: dict = {"model": model}
        if endpoint == "chat":
            body["messages"] = self.messages or [{"role": "user", "content": self.prompt or ""}]
        else:
            body["prompt"] = self.prompt if self.prompt is not None else _flatten(self.messages or [])
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
            if ignore_eos:
                body.update(ignore_eos=True, min_tokens=self.max_tokens)
        return {**body, **(extra or {})}


def _flatten(messages: list[dict]) -> str:
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n))


@dataclass(slots=True)
class SyntheticWorkload:
    """Random word prompts of `input_len` words; `shared_prefix` words common to every prompt
    (to exercise prefix caching), the rest unique per request."""

    input_len: LengthDist
    output_len: LengthDist
    shared_prefix: int = 0  # in words, with a tokenizer too
    seed: int = 0
    tokens: TokenPrompts | None = None  # input_len counts this tokenizer's tokens, else words

    def body(self, rng: np.random.Generator, n: int) -> str:
        """A prompt body of n tokens of `tokens`, else of n words."""
        return self.tokens.prompt(rng, n, words) if self.tokens is not None else words(rng, n)

    def requests(self) -> Iterator[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        prefix = words(rng, self.shared_prefix) if self.shared_prefix else ""
        while True:
            body = self.body(rng, self.input_len.sample(rng))
            yield RequestSpec(prompt=f"{prefix} {body}" if prefix else body, max_tokens=self.output_len.sample(rng))

    def describe(self) -> dict:
        return {
            "kind": "synthetic",
            "input_len": str(self.input_len),
            "output_len": str(self.output_len),
            "input_unit": f"tokens of {self.tokens.name}" if self.tokens else "words (≈ tokens)",
            "shared_prefix": self.shared_prefix,
            "seed": self.seed,
        }


@dataclass(slots=True)
class DatasetWorkload:
    """Prompts from a JSONL file (a JSON array works too), cycled. A row is one of:
    `{"prompt": …}`, `{"messages": [...]}`, or ShareGPT `{"conversations": [{"from": "human", "value": …},
    {"from": "gpt", "value": …}]}` (first human turn; the reply's word count as output length).
    A row may give `output_len`; an explicit `output_len` distribution overrides every row."""

    path: str
    output_len: LengthDist | None = None
    default_output_len: int = 128
    shared_prefix: int = 0
    seed: int = 0
    rows: list[tuple[RequestSpec, int | None]] = field(default_factory=list)

    def __post_init__(self):
        self.rows = load_dataset(self.path)

    def requests(self) -> Iterator[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        prefix = words(rng, self.shared_prefix) if self.shared_prefix else ""
        for spec, row_len in itertools.cycle(self.rows):
            n = self.output_len.sample(rng) if self.output_len else (row_len or self.default_output_len)
            yield _with_prefix(RequestSpec(spec.prompt, spec.messages, n), prefix)

    def describe(self) -> dict:
        return {
            "kind": "dataset",
            "path": self.path,
            "rows": len(self.rows),
            "seed": self.seed,
            "output_len": str(self.output_len) if self.output_len else "dataset",
            "shared_prefix": self.shared_prefix,
        }


def _with_prefix(spec: RequestSpec, prefix: str) -> RequestSpec:
    if not prefix:
        return spec
    if spec.messages is not None:
        spec.messages = [{"role": "system", "content": prefix}, *spec.messages]
    else:
        spec.prompt = f"{prefix} {spec.prompt}"
    return spec


def load_dataset(path: str) -> list[tuple[RequestSpec, int | None]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        rows = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(line) for line in text.splitlines() if line.strip()]
        )
    except ValueError as exc:
        raise ValueError(f"{path}: not JSONL (or a JSON array): {exc}") from None
    parsed = [_parse_row(row, path, i) for i, row in enumerate(rows, 1)]
    if not parsed:
        raise ValueError(f"{path}: the dataset holds no prompts")
    return parsed


def _parse_row(row, path: str, lineno: int) -> tuple[RequestSpec, int | None]:
    out_len = row.get("output_len") if isinstance(row, dict) else None
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return RequestSpec(prompt=row["prompt"]), out_len
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return RequestSpec(messages=row["messages"]), out_len
    turns = row.get("conversations") if isinstance(row, dict) else None
    if isinstance(turns, list):
        human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
        reply = [t.get("value", "") for t in turns if t.get("from") in ("gpt", "assistant")]
        if human:
            return RequestSpec(prompt=human[0]), out_len or (len(reply[0].split()) or None if reply else None)
    raise ValueError(f"{path}:{lineno}: a row needs `prompt`, `messages` or ShareGPT `conversations`")


@dataclass(slots=True)
class TraceWorkload:
    """Request shapes from a replay trace: each entry's prompt or input/output lengths, falling back
    to `base` (a synthetic workload) for what an entry leaves out."""

    entries: list[TraceEntry]
    base: SyntheticWorkload

    def requests(self) -> Iterator[RequestSpec]:
        rng = np.random.default_rng(self.base.seed)
        for entry, spec in zip(self.entries, self.base.requests(), strict=False):
            if entry.prompt is not None:
                spec.prompt = entry.prompt
            elif entry.input_len is not None:
                spec.prompt = self.base.body(rng, entry.input_len)
            if entry.output_len is not None:
                spec.max_tokens = entry.output_len
            yield spec

    def describe(self) -> dict:
        return {"kind": "trace", **self.base.describe()}
