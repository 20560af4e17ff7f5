"""tree-attn: exact long-context decode attention across GPUs (Tree Attention, arXiv 2408.04093).

Public API (stable names):

- :func:`decode_attention` — local decode attention with its log-sum-exp (torch or Triton).
- :func:`merge_partials` — exact merge of partial ``(out, lse)`` states.
- :func:`tree_decode` — the collective: every rank gets attention over the union of KV shards.
- :func:`ring_decode` — the Ring Attention baseline with the same contract.
- :class:`DecodeStep`, :class:`TreeDecodeStep` — the same on static buffers, prepared once and
  replayed as a CUDA graph on GPUs (for decode loops and serving engines).
- :func:`quantize_kv` — an fp8 (``float8_e4m3fn``) KV cache and its per-KV-head scales, for the
  ``k_scale``/``v_scale`` keywords of all of the above.

Names are resolved on first use (PEP 562), so ``import tree_attn`` and ``tree-attn --help`` do not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    DistributedError,
    KernelUnavailableError,
    ProfileError,
    ShapeError,
    TopologyError,
    TreeAttnError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "decode_attention": ".kernels.dispatch",
    "merge_partials": ".reduce.state",
    "tree_decode": ".reduce.collectives",
    "ring_decode": ".reduce.ring",
    "ReductionPlan": ".reduce.plan",
    "DecodeStep": ".kernels.prepared",
    "TreeDecodeStep": ".reduce.collectives",
    "quantize_kv": ".kernels.fp8",
}

__all__ = [
    "ConfigError",
    "DecodeStep",
    "DistributedError",
    "KernelUnavailableError",
    "ProfileError",
    "ReductionPlan",
    "ShapeError",
    "TopologyError",
    "TreeAttnError",
    "TreeDecodeStep",
    "__version__",
    "decode_attention",
    "merge_partials",
    "quantize_kv",
    "ring_decode",
    "tree_decode",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tree_attn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .kernels.dispatch import decode_attention
    from .kernels.fp8 import quantize_kv
    from .kernels.prepared import DecodeStep
    from .reduce.collectives import TreeDecodeStep, tree_decode
    from .reduce.plan import ReductionPlan
    from .reduce.ring import ring_decode
    from .reduce.state import merge_partials
