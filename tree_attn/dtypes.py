"""The one dtype vocabulary of tree-attn: canonical names, the aliases users type, sizes.

Canonical names are torch's (``float32``, ``float16``, ``bfloat16``); profiles, run specs and the
CLI store and print those. Every fact about a dtype is one row of :data:`TABLE` (a new dtype is a
new row); the lookups below are derived from it. No torch import at module level: profiles and the
CLI's help use this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class DType:
    """One dtype: its canonical (torch) ``name``, bytes per element, the ``short`` name tables and
    labels print, and the other spellings users type (``aliases``)."""

    name: str
    itemsize: int
    short: str
    aliases: tuple[str, ...] = ()


# In the order tables list them.
TABLE: tuple[DType, ...] = (
    DType("float32", 4, "fp32", ("fp32", "float")),
    DType("float16", 2, "fp16", ("fp16", "half")),
    DType("bfloat16", 2, "bf16", ("bf16",)),
    # KV-cache dtypes only (with dequantization scales): OCP e4m3, and AMD CDNA3's e4m3 variant
    # "fnuz" (bias 8, no -0 or inf).
    DType("float8_e4m3fn", 1, "fp8"),
    DType("float8_e4m3fnuz", 1, "fp8_fnuz"),
)

# Canonical names, in the order tables list them.
NAMES: tuple[str, ...] = tuple(d.name for d in TABLE)

ALIASES: dict[str, str] = {alias: d.name for d in TABLE for alias in (d.name, *d.aliases)}

ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in TABLE}

# Short names for tables and labels.
SHORT: dict[str, str] = {d.name: d.short for d in TABLE}

FP8: frozenset[str] = frozenset({"float8_e4m3fn", "float8_e4m3fnuz"})


def canonical(dtype: Any) -> str | None:
    """Canonical name of a torch dtype or an alias such as ``"bf16"`` or ``"torch.bfloat16"``;
    ``None`` if not one of ours."""
    if not isinstance(dtype, str) and not hasattr(dtype, "is_floating_point"):  # neither a name nor a torch.dtype
        return None
    key = str(dtype).strip().lower()
    return ALIASES.get(key.removeprefix("torch."))


def parse_dtype(dtype: Any) -> str:
    """Canonical name of ``dtype``; :class:`ConfigError` naming the accepted spellings otherwise."""
    name = canonical(dtype)
    if name is None:
        shorts, names = ", ".join(SHORT[n] for n in NAMES), ", ".join(NAMES)
        raise ConfigError(f"dtype must be one of {shorts} (or {names}); got {dtype!r}")
    return name


def torch_dtype(dtype: Any):
    """The ``torch.dtype`` of a name, alias or torch dtype."""
    import torch

    return getattr(torch, parse_dtype(dtype))


def itemsize(dtype: Any) -> int:
    """Bytes per element of a name, alias or torch dtype."""
    return ITEMSIZE[parse_dtype(dtype)]


def is_fp8(dtype: Any) -> bool:
    """Whether a name, alias or torch dtype is one of the fp8 KV-cache dtypes."""
    return canonical(dtype) in FP8
