"""The one dtype vocabulary of tree-attn: canonical names, the aliases users type, sizes.

Canonical names are torch's (``float32``, ``float16``, ``bfloat16``); profiles, run specs and the
CLI store and print those. No torch import at module level: profiles and the CLI's help use this.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

# Canonical names, in the order tables list them. The fp8 ones are KV-cache dtypes only (with
# dequantization scales): OCP e4m3, and AMD CDNA3's e4m3 variant "fnuz" (bias 8, no -0 or inf).
NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz")

ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e4m3fnuz": "float8_e4m3fnuz",
}

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1}

# Short names for tables and labels.
SHORT: dict[str, str] = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8_fnuz",
}

FP8: frozenset[str] = frozenset({"float8_e4m3fn", "float8_e4m3fnuz"})


def canonical(dtype: Any) -> str | None:
    """Canonical name of a torch dtype or an alias such as ``"bf16"`` or ``"torch.bfloat16"``; ``None`` if not one of ours."""
    if not isinstance(dtype, str) and not hasattr(dtype, "is_floating_point"):  # neither a name nor a torch.dtype
        return None
    key = str(dtype).strip().lower()
    return ALIASES.get(key.removeprefix("torch."))


def parse_dtype(dtype: Any) -> str:
    """Canonical name of ``dtype``; :class:`ConfigError` naming the accepted spellings otherwise."""
    name = canonical(dtype)
    if name is None:
        raise ConfigError(f"dtype must be one of fp32, fp16, bf16 (or float32, float16, bfloat16); got {dtype!r}")
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
