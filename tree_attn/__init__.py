"""tree-attn: exact long-context decode attention across GPUs (Tree Attention, arXiv 2408.04093).

Public API (stable names):

- :func:`decode_attention` — local decode attention with its log-sum-exp (torch or Triton).
- :func:`merge_partials` — exact merge of partial ``(out, lse)`` states.
- :func:`tree_decode` — the collective: every rank gets attention over the union of KV shards.
- :func:`ring_decode` — the Ring Attention baseline with the same contract.
"""

from .errors import (
    ConfigError,
    DistributedError,
    KernelUnavailableError,
    ProfileError,
    ShapeError,
    TopologyError,
    TreeAttnError,
)
from .kernels.dispatch import decode_attention
from .reduce.collectives import tree_decode
from .reduce.merge import merge_partials
from .reduce.plan import ReductionPlan
from .reduce.ring import ring_decode

__version__ = "0.1.0"

__all__ = [
    "decode_attention",
    "merge_partials",
    "tree_decode",
    "ring_decode",
    "ReductionPlan",
    "TreeAttnError",
    "ShapeError",
    "ConfigError",
    "DistributedError",
    "TopologyError",
    "ProfileError",
    "KernelUnavailableError",
    "__version__",
]
