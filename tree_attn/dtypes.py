"""The one dtype vocabulary of tree-attn: canonical names, the aliases users type, sizes.

Canonical names are torch's (``float32``, ``float16``, ``bfloat16``, ``float8_e4m3fn``); profiles,
run specs and the CLI store and print those. Every fact about a dtype is one row of :data:`TABLE` (a
new dtype is a new row); the lookups below are derived from it. No torch import at module level:
profiles and the CLI's help use this.

Two vocabularies: every row is a KV-cache dtype (:func:`parse_kv_dtype`), but the fp8 rows are
KV-only (a cache stored in fp8 with dequantization scales): queries, outputs and model weights
stay float32, float16 or bfloat16 (:func:`parse_dtype`). An option that takes one of the two says
which, and a KV-only name given where a compute dtype is expected is refused with a message that
points at the KV option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class DType:
    """One dtype: its canonical (torch) ``name``, bytes per element, the ``short`` name tables and
    labels print, the other spellings users type (``aliases``), and whether it holds KV caches
    only (``kv_only``: fp8, which needs dequantization scales)."""

    name: str
    itemsize: int
    short: str
    aliases: tuple[str, ...] = ()
    kv_only: bool = False


# In the order tables list them.
TABLE: tuple[DType, ...] = (
    DType("float32", 4, "fp32", ("fp32", "float")),
    DType("float16", 2, "fp16", ("fp16", "half")),
    DType("bfloat16", 2, "bf16", ("bf16",)),
    # KV-cache dtypes only (with dequantization scales): OCP e4m3 ("fp8", as vLLM's and SGLang's
    # --kv-cache-dtype fp8 means it), and AMD CDNA3's e4m3 variant "fnuz" (bias 8, no -0 or inf).
    DType("float8_e4m3fn", 1, "fp8", ("fp8", "e4m3", "fp8_e4m3"), kv_only=True),
    DType("float8_e4m3fnuz", 1, "fp8_fnuz", ("fp8_fnuz", "e4m3fnuz", "fp8_e4m3fnuz"), kv_only=True),
)

# Canonical names, in the order tables list them: every dtype (KV caches), and those of queries,
# outputs and weights.
NAMES: tuple[str, ...] = tuple(d.name for d in TABLE)
COMPUTE_NAMES: tuple[str, ...] = tuple(d.name for d in TABLE if not d.kv_only)

ALIASES: dict[str, str] = {alias: d.name for d in TABLE for alias in (d.name, *d.aliases)}

ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in TABLE}

# Short names for tables and labels.
SHORT: dict[str, str] = {d.name: d.short for d in TABLE}

FP8: frozenset[str] = frozenset(d.name for d in TABLE if d.kv_only)


def canonical(dtype: Any) -> str | None:
    """Canonical name of a torch dtype or an alias such as ``"bf16"`` or ``"torch.bfloat16"``;
    ``None`` if not one of ours."""
    if not isinstance(dtype, str) and not hasattr(dtype, "is_floating_point"):  # neither a name nor a torch.dtype
        return None
    key = str(dtype).strip().lower()
    return ALIASES.get(key.removeprefix("torch."))


def _accepted(names: tuple[str, ...]) -> str:
    return f"{', '.join(SHORT[n] for n in names)} (or {', '.join(names)})"


def parse_dtype(dtype: Any) -> str:
    """Canonical name of a compute dtype (queries, outputs, weights: float32, float16, bfloat16);
    :class:`ConfigError` naming the accepted spellings otherwise (and, for an fp8 name, that fp8 is
    a KV-cache dtype)."""
    name = canonical(dtype)
    if name is None or name in FP8:
        hint = ("; fp8 holds KV caches only (with dequantization scales): give it as the KV dtype (--kv-dtype "
                f"{SHORT[name]}), with a query of one of these" if name in FP8 else "")
        raise ConfigError(f"dtype must be one of {_accepted(COMPUTE_NAMES)}; got {dtype!r}{hint}")
    return name


def parse_kv_dtype(dtype: Any) -> str:
    """Canonical name of a KV-cache dtype: a compute dtype or fp8 (``fp8``/``e4m3`` =
    ``float8_e4m3fn``, ``fp8_fnuz`` = ``float8_e4m3fnuz``); :class:`ConfigError` otherwise."""
    name = canonical(dtype)
    if name is None:
        raise ConfigError(f"KV dtype must be one of {_accepted(NAMES)}; got {dtype!r}")
    return name


def torch_dtype(dtype: Any):
    """The ``torch.dtype`` of a name, alias or torch dtype (either vocabulary)."""
    import torch

    return getattr(torch, parse_kv_dtype(dtype))


def itemsize(dtype: Any) -> int:
    """Bytes per element of a name, alias or torch dtype (either vocabulary)."""
    return ITEMSIZE[parse_kv_dtype(dtype)]


def is_fp8(dtype: Any) -> bool:
    """Whether a name, alias or torch dtype is one of the fp8 KV-cache dtypes."""
    return canonical(dtype) in FP8
