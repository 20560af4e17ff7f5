"""The one dtype vocabulary of tree-attn: canonical names, the aliases users type, sizes.

Canonical names are torch's (``float32``, ``float16``, ``bfloat16``); profiles, run specs and the
CLI store and print those. No torch import at module level: profiles and the CLI's help use this.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

# Canonical names, in the order tables list them.
NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")

ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# Short names for tables and labels.
SHORT: dict[str, str] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


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
