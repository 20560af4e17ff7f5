"""Route a Hugging Face model's attention through tree-attn, by transformers' attention hook.

:func:`use_tree_attention` registers one function under the name ``"tree_attn"`` in
``transformers.AttentionInterface`` and sets it as the model's attention implementation. The
model's own code computes q, k and v (projections, RoPE) and calls that function in every layer;
the function reads a context passed as the forward's keyword argument ``tree_attn_ctx``:

- a prefill context (:class:`.prefill.ShardedPrefill`, anything with an ``attend`` method): the
  layer's attention is the context's (this rank's queries over the whole prompt, exchanged around
  the ring of ranks), which also keeps the rank's K and V.
- :class:`DecodeContext`: this rank's paged KV shard (:class:`.kv_store.PagedKVShard`); the
  new token's K and V go to the shard that holds new tokens (the last rank's), then the layer's
  attention over all ranks' shards is ``tree_decode``, ``ring_decode`` or, on one process,
  ``decode_attention``.

The model is called with ``use_cache=False`` and explicit ``position_ids``: the KV cache lives
here, not in a transformers ``Cache``. No attention mask is built for a registered function
(transformers skips it); causality is known from the positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ConfigError
from ...kernels.dispatch import decode_attention
from ...reduce.collectives import tree_decode
from ...reduce.comm import CommStats
from ...reduce.plan import ReductionPlan
from ...reduce.ring import ring_decode
from .kv_store import PagedKVShard

ATTENTION_NAME = "tree_attn"
CONTEXT_KWARG = "tree_attn_ctx"


@dataclass
class DecodeContext:
    """One rank's decode state. ``strategy``: ``tree`` (with ``plan``), ``ring`` (with every
    rank's pool capacity in ``ring_lengths``) or ``local`` (one process, no collective).
    ``holds_new``: this rank's shard receives the new tokens' K and V."""

    store: PagedKVShard
    strategy: str
    holds_new: bool
    plan: ReductionPlan | None = None
    ring_lengths: list[int] | None = None
    impl: str = "auto"
    config: Any = None
    stats: CommStats = field(default_factory=CommStats)
    _new: int = 0

    def begin(self, new_tokens: int) -> None:
        """Before a forward over ``new_tokens`` tokens: make room for them in the shard."""
        self._new = new_tokens if self.holds_new else 0
        self.store.seq_lens.fill_(self.store.length + self._new)

    def abort(self) -> None:
        """Drop the tokens of a forward (a warm-up): the shard stays as before :meth:`begin`."""
        self.store.seq_lens.fill_(self.store.length)
        self._new = 0

    def end(self) -> None:
        """After the forward: the new tokens are part of the shard."""
        self.store.set_length(self.store.length + self._new)
        self._new = 0


def _decode(ctx: DecodeContext, layer: int, query, key, value, scale: float) -> torch.Tensor:
    """One layer of a decode step on this rank: store the new K/V (if this rank holds them), then
    attention over every rank's shard."""
    store = ctx.store
    b, _, sq, d = query.shape
    if b != 1:
        raise ConfigError(f"generate decodes one sequence; got a batch of {b}")
    if ctx._new:
        store.write(layer, store.length, key[0].transpose(0, 1), value[0].transpose(0, 1))
    q = query.transpose(1, 2).contiguous()  # [1, Sq, Hq, D]
    if sq == 1:
        q = q[:, 0]  # [1, Hq, D]
    kwargs = dict(seq_lens=store.seq_lens, block_table=store.block_table, scale=scale, impl=ctx.impl,
                  config=ctx.config, causal=sq > 1)
    pools = (store.k[layer], store.v[layer])
    if ctx.strategy == "tree":
        out, _ = tree_decode(q, *pools, plan=ctx.plan, stats=ctx.stats, **kwargs)
    elif ctx.strategy == "ring":
        out, _ = ring_decode(q, *pools, lengths=ctx.ring_lengths, stats=ctx.stats, **kwargs)
    else:
        out, _ = decode_attention(q, *pools, **kwargs)
    return out.view(1, sq, -1, d)


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as ``"tree_attn"``: transformers' attention-interface signature.

    query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]`` (this forward's tokens, RoPE applied).
    Returns ``(out [B, S, Hq, D], None)``.
    """
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise ConfigError(f"the {ATTENTION_NAME!r} attention needs the forward's {CONTEXT_KWARG}= argument")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    attend = getattr(ctx, "attend", None)
    if attend is not None:  # a prefill context
        return attend(layer, query, key, value, scale), None
    return _decode(ctx, layer, query, key, value, scale), None


def use_tree_attention(model) -> None:
    """Register the hook (once per process) and route ``model``'s attention through it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
