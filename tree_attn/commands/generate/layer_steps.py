"""One layer's decode attention prepared once per session: what the attention hook calls per layer.

vLLM's metadata builder resolves a step's attention metadata once and every layer only reads it;
here the same holds for the whole decode session of one strategy. The first forward of a query
shape (Sq new tokens) builds, for every layer, a step bound to static tensors: the layer's paged
pools, the shard's block table and ``seq_lens`` (shared by the layers), a static query buffer and
static outputs. The shape checks, the block-table check, the kernel's resolution and, for a tree,
the merge's peers and buffers all happen there, once (:func:`build_layer_step`). A layer's call
afterwards copies q into its buffer and runs the step: no cache look-up, no object built, no
shape check (:class:`LayerStep`).

- ``tree`` (and ``allreduce``): :class:`~tree_attn.reduce.collectives.TreeDecodeStep` (building
  it is collective: every rank builds each layer's step at the same point, the first forward);
- ``local`` (one process): :class:`~tree_attn.kernels.prepared.DecodeStep`;
- ``ring``: :class:`~tree_attn.reduce.ring.RingDecodeStep` (eager: whole shards travel, an fp8
  pool with its owner's scales).

None of these captures a graph of its own: on GPUs the whole token step, every layer included, is
one graph (:mod:`.token_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .hf_attention import DecodeContext


class LayerStep:
    """One layer's prepared attention for ``Sq`` query tokens: ``out = step(query)``.

    ``query [1, Hq, Sq, D]`` (transformers' layout, RoPE applied) is copied into the static
    buffer ``q`` (``[1, Hq, D]``, or ``[1, Sq, Hq, D]`` for several tokens); ``run()`` computes the
    attention over every rank's shard into static outputs; the result is returned as
    ``[1, Sq, Hq, D]`` (a view of the step's static output, overwritten by its next call).
    ``traffic``: what this rank sends per call (tree steps; None otherwise).
    """

    __slots__ = ("out_shape", "q", "run", "sq", "step", "traffic")

    def __init__(self, q: torch.Tensor, step: Any, run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 traffic: Any = None) -> None:
        self.q, self.step, self.run, self.traffic = q, step, run, traffic
        self.sq = q.shape[1] if q.dim() == 4 else 1
        self.out_shape = (1, self.sq, q.shape[-2], q.shape[-1])

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        if self.sq == 1:
            self.q.copy_(query[:, :, 0])
        else:
            self.q.copy_(query.transpose(1, 2))
        return self.run()[0].view(self.out_shape)

    def close(self) -> None:
        """Free what the step holds (a graph, if it had one: these steps capture none)."""
        close = getattr(self.step, "close", None)
        if close is not None:
            close()


def build_layer_step(ctx: DecodeContext, layer: int, query: torch.Tensor, scale: float) -> LayerStep:
    """Layer ``layer``'s step for the shape of ``query [1, Hq, Sq, D]``: the one place where a
    decode session's prepared steps are built (kernel options pass through here once).

    The shard's ``seq_lens`` must already hold this forward's new tokens (``DecodeContext``'s
    ``begin`` or ``place_next``): under several new tokens the rank that holds them checks here,
    once, that its shard has them. A tree step is collective (its shape check exchanges a small
    descriptor, on the first layer only: every layer has the same shapes).
    """
    b, hq, sq, d = query.shape
    if b != 1:
        raise ConfigError(f"generate decodes one sequence; got a batch of {b}")
    store = ctx.store
    # An fp8 pool: the layer's per-KV-head scales ([Hkv] float32), fixed by this rank's prefill (1
    # where it had no token: kv_store) and used by every later token's write, so the step built
    # once reads every token right. The ring sends them with the pool (each rank's are its own).
    scales = store.scales(layer)
    q = torch.empty((1, hq, d) if sq == 1 else (1, sq, hq, d), dtype=query.dtype, device=query.device)
    pools = (store.k[layer], store.v[layer])
    kernel = {"scale": scale, "impl": ctx.impl, "config": ctx.config, "block_table": store.block_table,
              "causal": sq > 1, **scales}
    if ctx.strategy == "tree":
        from ...reduce.collectives import TreeDecodeStep

        step = TreeDecodeStep(q, *pools, store.seq_lens, plan=ctx.plan, cuda_graph=False, check_values=False,
                              check_shapes=layer == 0, **kernel)
        return LayerStep(q, step, step, step.traffic)
    if ctx.strategy == "ring":
        from functools import partial

        from ...reduce.ring import RingDecodeStep

        step = RingDecodeStep(q, *pools, store.seq_lens, lengths=ctx.ring_lengths, **kernel)
        return LayerStep(q, step, partial(step, ctx.stats))  # counts what it sends into the context's stats
    if ctx.strategy == "local":
        from ...kernels.prepared import DecodeStep

        step = DecodeStep(q, *pools, store.seq_lens, cuda_graph=False, check_values=False, **kernel)
        return LayerStep(q, step, step)
    raise ConfigError(f"unknown decode strategy {ctx.strategy!r}; expected tree, ring or local")
