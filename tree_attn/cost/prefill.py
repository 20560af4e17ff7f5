"""A napkin model of generate's sharded prefill on GPUs: compute at a datasheet FLOP rate, the
ring's K/V blocks over the link, overlapped.

Per rank ``r`` (its zig-zag share ``S_r`` of the ``n`` prefill tokens, its causal query-key pairs
``P_r``), per layer:

- linear work (projections, MLP): ``2 S_r W`` FLOPs, ``W`` a layer's weights (parameters);
- attention: ``4 Hq D`` FLOPs per query-key pair (``QK^T`` and ``PV``), ``P_r`` pairs;
- the ring: ``p - 1`` steps; step ``s`` receives a block of ``S_{r-s}`` tokens, ``2 Hkv D e`` bytes
  each, over the link (:meth:`LinkParams.bulk_us`, or ``p2p_us`` without a bulk figure). The next
  block is posted before the current one is computed on, so each step costs the larger of its
  attention and its transfer; the rank's own block (step 0) has nothing to wait for.

FLOP rate: ``efficiency x tensor_tflops`` (the datasheet's dense bf16 peak; ``efficiency`` 0.5 is
assumed, the fraction large-GEMM prefill kernels typically reach, not measured here). The
prefill's time is its slowest rank's (the ranks wait for each other every step). The final norm and
the LM head run on the last token only, and are left out; so are kernel launch gaps (a prefill's
kernels are large). A prediction, checked against nothing measured on GPUs yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes import itemsize
from ..reduce.zigzag import zigzag
from .capacity import ModelDims
from .devices import DeviceSpec
from .links import LinkParams

EFFICIENCY = 0.5  # assumed achieved fraction of the datasheet's dense tensor peak in prefill


@dataclass(frozen=True)
class PrefillPrediction:
    """The predicted prefill of ``tokens`` tokens on ``world`` ranks, seconds (slowest rank)."""

    tokens: int
    world: int
    compute_s: float  # the slowest rank's FLOPs at the assumed rate
    exposed_comm_s: float  # transfer time not hidden behind attention
    ring_bytes_per_rank: int  # sent by the busiest rank, all layers

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "world": self.world, "compute_s": self.compute_s,
                "exposed_comm_s": self.exposed_comm_s, "total_s": self.total_s,
                "ring_bytes_per_rank": self.ring_bytes_per_rank}


def layer_weights(dims: ModelDims) -> int:
    """Parameters of one decoder layer (what its linear work multiplies by)."""
    embeds = dims.vocab * dims.hidden * (1 if dims.tied else 2)
    return (dims.params() - embeds - dims.hidden) // dims.layers


def predict_prefill(dims: ModelDims, tokens: int, world: int, device: DeviceSpec, link: LinkParams | None,
                    dtype: str = "bfloat16", efficiency: float = EFFICIENCY) -> PrefillPrediction:
    """The model of the module for ``tokens`` prefill tokens over ``world`` ranks of ``device``
    joined by ``link`` (None: one rank)."""
    shards = zigzag(tokens, world)
    rate = efficiency * device.tensor_tflops * 1e12
    w = layer_weights(dims)
    per_pair = 4 * dims.q_heads * dims.head_dim
    block_bytes = 2 * dims.kv_heads * dims.head_dim * itemsize(dtype)
    worst = None
    for r in range(world):
        s_r = shards.size(r)
        own_pairs = s_r * (s_r + 1) // 2
        other_pairs = shards.causal_pairs(r) - own_pairs
        linear_s = 2 * s_r * w / rate
        own_s = own_pairs * per_pair / rate
        exposed = 0.0
        attn_other_s = other_pairs * per_pair / rate
        sent = 0
        for step in range(1, world):
            src = (r - step) % world
            nbytes = shards.size(src) * block_bytes
            move_s = 0.0 if nbytes == 0 or link is None else (
                link.bulk_us(nbytes) if link.bulk_gbps is not None else link.p2p_us(nbytes)) * 1e-6
            # the step's attention, spread evenly over the steps (zig-zag: each step is one prefix call)
            exposed += max(0.0, move_s - attn_other_s / (world - 1))
            sent += shards.size((r - step + 1) % world) * block_bytes  # the block it held at the step before
        compute = dims.layers * (linear_s + own_s + attn_other_s)
        pred = PrefillPrediction(tokens, world, compute, dims.layers * exposed, dims.layers * sent)
        if worst is None or pred.total_s > worst.total_s:
            worst = pred
    assert worst is not None
    return worst


__all__ = ["EFFICIENCY", "PrefillPrediction", "layer_weights", "predict_prefill"]
