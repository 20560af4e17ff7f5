"""The one way counts are written on the command line: ``65536``, ``64K``, ``5.12M``.

K is 1,024 (KV caches and shards come in powers of two: 64K = 65,536 tokens) and M is 1,000,000
(as the Tree Attention paper writes 5.12M tokens), either case. A decimal is taken exactly
(``4.1M`` is 4,100,000, not a float's 4,099,999.99...) and must come out whole. Every option that
counts tokens or sequences, in every command, reads its value through :func:`parse_count`, so one
spelling works everywhere. No torch here: the CLI's option parsing uses it.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .errors import ConfigError

# How help texts state the rule (once per option that takes it).
SUFFIX_RULE = "K = 1,024, M = 1,000,000"  # the words of help texts and errors

_UNITS = {"": 1, "k": 1024, "m": 1_000_000}
# An optional sign (so that "-1" reaches the option's own range check, which names the option),
# digits with an optional decimal part, an optional K or M.
_COUNT = re.compile(r"\s*([+-]?)(\d+(?:\.\d+)?)\s*([kKmM]?)\s*")


def parse_count(text: str | int) -> int:
    """``text`` as a whole count: ``"65536"`` -> 65536, ``"64K"``/``"64k"`` -> 65536,
    ``"5.12M"`` -> 5120000; an int is returned as it is. No range check: the caller's.

    Raises ConfigError for anything else (``"64X"``, ``"0.3K"`` = 307.2, ``"1e6"``, ``""``)."""
    if isinstance(text, bool):
        raise ConfigError(f"{text!r} is not a count")
    if isinstance(text, int):
        return text
    m = _COUNT.fullmatch(str(text))
    if m is None:
        raise ConfigError(f"{str(text)!r} is not a count: write a whole number such as 65536, 64K or 5.12M "
                          f"({SUFFIX_RULE})")
    sign, digits, unit = m.groups()
    value = Fraction(digits) * _UNITS[unit.lower()]  # exact: no float rounding of 4.1M
    if value.denominator != 1:
        raise ConfigError(f"{str(text).strip()!r} is not a whole number ({float(value):,.6g}; {SUFFIX_RULE})")
    return -int(value) if sign == "-" else int(value)


def parse_count_list(text: str) -> list[int]:
    """A comma list of counts (``"16K,64K,1M"``), each by :func:`parse_count`, in the order given."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"expected a comma-separated list of counts such as 16K,64K; got {str(text)!r}")
    return [parse_count(t) for t in items]
