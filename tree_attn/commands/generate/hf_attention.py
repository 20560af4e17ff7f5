"""Route a Hugging Face model's attention through tree-attn, by transformers' attention hook.

:func:`use_tree_attention` registers one function under the name ``"tree_attn"`` in
``transformers.AttentionInterface`` and sets it as the model's attention implementation. The
model's own code computes q, k and v (projections, RoPE) and calls that function in every layer;
the function reads a context passed as the forward's keyword argument ``tree_attn_ctx``:

- :class:`PrefillContext`: one process attends the prompt in chunks (each chunk causally over
  itself and fully over the chunks before it, merged exactly by their log-sum-exps) and keeps
  every layer's K and V.
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
from ...reduce.state import merge_partials
from .kv_store import PagedKVShard

ATTENTION_NAME = "tree_attn"
CONTEXT_KWARG = "tree_attn_ctx"
_QUERY_ROWS = 64  # query rows per block of the portable prefill attention (bounds its score memory)


@dataclass
class PrefillContext:
    """Prefill in one process: per layer K and V ``[Hkv, capacity, D]``; ``length`` tokens valid
    (the same for every layer once a chunk has passed all layers)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, layers: int, capacity: int, kv_heads: int, head_dim: int, *, dtype, device) -> PrefillContext:
        shape = (kv_heads, capacity, head_dim)
        return cls(k=[torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)],
                   v=[torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)])

    def tokens(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of tokens ``start..stop - 1`` as ``[n, Hkv, D]`` views."""
        return self.k[layer][:, start:stop].transpose(0, 1), self.v[layer][:, start:stop].transpose(0, 1)


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


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """``(out [H, S, D], lse [H, S])`` float32 of queries ``q [Hq, S, D]`` over ``k, v [Hkv, N, D]``;
    ``causal`` needs S == N (query i sees keys 0..i)."""
    if q.device.type == "cpu":
        # PyTorch's flash attention for CPU (grouped-query aware, never materialises the scores).
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale
        )
        return out[0].float(), lse[0].float()
    return attention_blockwise(q, k, v, scale, causal)


def attention_blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """The portable path of :func:`attention_with_lse` (GPUs): blocks of query rows, float32
    scores ``[Hq, rows, N]`` per block, exact log-sum-exp."""
    hq, s, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qg = q.float().view(hkv, g, s, d)
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for start in range(0, s, _QUERY_ROWS):
        stop = min(s, start + _QUERY_ROWS)
        scores = torch.einsum("hgsd,hnd->hgsn", qg[:, :, start:stop], kf) * scale
        if causal:
            rows = torch.arange(start, stop, device=q.device).view(-1, 1)
            cols = torch.arange(k.shape[1], device=q.device).view(1, -1)
            scores = scores.masked_fill(cols > rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.einsum("hgsn,hnd->hgsd", torch.exp(scores - lse.unsqueeze(-1)), vf))
        lses.append(lse)
    return torch.cat(outs, 2).view(hq, s, d), torch.cat(lses, 2).view(hq, s)


def _prefill(ctx: PrefillContext, layer: int, query, key, value, scale: float) -> torch.Tensor:
    """One chunk of one layer: keep its K/V, attend causally to itself and fully to the past."""
    if query.shape[0] != 1:
        raise ConfigError(f"generate prefills one sequence; got a batch of {query.shape[0]}")
    start, n = ctx.length, query.shape[2]
    if start + n > ctx.k[layer].shape[1]:
        raise ConfigError(f"prefill past its capacity: {start + n} tokens, room for {ctx.k[layer].shape[1]}")
    ctx.k[layer][:, start:start + n] = key[0]
    ctx.v[layer][:, start:start + n] = value[0]
    q = query[0]
    out, lse = attention_with_lse(q, key[0], value[0], scale, causal=True)
    if start:
        past_out, past_lse = attention_with_lse(q, ctx.k[layer][:, :start], ctx.v[layer][:, :start], scale,
                                                causal=False)
        out, lse = merge_partials(torch.stack([out, past_out]), torch.stack([lse, past_lse]))
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0)  # [1, S, Hq, D]


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
    if isinstance(ctx, PrefillContext):
        return _prefill(ctx, layer, query, key, value, scale), None
    return _decode(ctx, layer, query, key, value, scale), None


def use_tree_attention(model) -> None:
    """Register the hook (once per process) and route ``model``'s attention through it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
