"""Defaults the commands share, each stated once, and the checks and parsers that go with them.

The options dataclasses of ``run``, ``generate``, ``tune`` and ``simulate`` take their defaults from
here (and from :mod:`tree_attn.launch.setup` for the launch: ``auto`` device, backend and dtype,
the timeout); the CLI takes its defaults from those dataclasses. No torch import.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..launch.setup import AUTO, DEFAULT_TIMEOUT_S
from ..sizes import parse_count
from ..validate import is_int

# Llama-3.1-8B's attention: 32 query heads, 8 KV heads, head dim 128.
HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
BATCH = 1
SEED = 0
MAX_SEQ = 100_000_000  # tokens of one sequence, the most any command takes

# Inputs' generator seeds are derived from the seed (seed * 1,000,003 + ...): 2**40 keeps them
# within 64 bits.
MAX_SEED = 2**40


def check_seed(seed: int, what: str = "--seed") -> None:
    """A seed is an integer in 0..:data:`MAX_SEED` (both ends included)."""
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:  # check_int would spell 2**40 out
        raise ConfigError(f"{what} must be an integer in 0..2**40; got {seed!r}")


def parse_tokens(text: str) -> int:
    """``32768``, ``32K`` (x1,024), ``5.12M`` (x1,000,000, as the paper writes 5.12M tokens): the
    CLI's one count syntax (``tree_attn.sizes``), then 1 to :data:`MAX_SEQ` tokens."""
    try:
        n = parse_count(text)
    except ConfigError as exc:
        raise ConfigError(f"sequence length: {exc}") from None
    if not 1 <= n <= MAX_SEQ:
        raise ConfigError(f"sequence length {text!r}: expected 1 to {MAX_SEQ:,} tokens")
    return n


__all__ = ["AUTO", "BATCH", "DEFAULT_TIMEOUT_S", "HEADS", "HEAD_DIM", "KV_HEADS", "MAX_SEED", "MAX_SEQ", "SEED",
           "check_seed", "parse_tokens"]
