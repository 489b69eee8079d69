"""Boolean settings from the environment, read one way everywhere."""

from __future__ import annotations

import os

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def env_flag(name: str) -> bool:
    """True when `name` is set to 1, true, yes or on (any case, surrounding spaces ignored)."""
    return os.environ.get(name, "").strip().lower() in TRUE_WORDS
