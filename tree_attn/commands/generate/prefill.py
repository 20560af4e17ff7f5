"""Sharded (context-parallel) prefill of ``tree-attn generate``: each rank prefills its own positions.

The ``n`` prefill tokens (the prompt but its last token, which the first decode step feeds) are
assigned to the ranks by :func:`tree_attn.reduce.zigzag.zigzag`. Rank r runs the model on its own
token ids only, with their true positions (``position_ids``: transformers' own RoPE sees where
each token sits), in one forward. In every layer the attention hook hands this rank's queries,
keys and values to :func:`tree_attn.reduce.ring_prefill.ring_prefill_attention` (the K/V blocks
travel around the ring, the partial states merge exactly) and writes this rank's K and V straight
into its paged pool (:class:`.kv_store.PagedKVShard`). No process holds more than its own part of
any layer's cache, and the launching process holds none.

A rank with no token (fewer prompt tokens than ranks) cannot run the model on an empty sequence
(transformers' projections reject it), so it calls the layer exchange itself, once per layer, with
empty blocks: it relays the others' blocks like any rank.

An fp8 pool (``--kv-dtype fp8``) is quantized as it is written, with per-layer, per-KV-head scales
that the ranks agree on before the layer's first write (:meth:`ShardedPrefill.agree_on_scales`):
the whole prompt's maxima, the scales one process would take, so every strategy, world size and
the reference quantize alike. A rank with no prompt token takes them too (its maxima count as
0), and when it is the last rank it quantizes every new token with them, before any decode step
reads its pool; a new token beyond the prompt's largest saturates at 448 times the scale. Only a
prompt with no prefill token at all (a single token) leaves every maximum 0: its scales are 1, a
zero maximum's (``scales_for``). The prefill's own attention reads the unquantized K/V (the blocks
travel in the model's dtype); the decode steps read the pools.

The MLP is applied in chunks of :data:`MLP_ROWS` tokens (:func:`chunk_mlp`): it is token-wise, so
the result is the same, and its ``3 x intermediate`` activations per token, the largest of a
layer, stay bounded whatever the share of the prompt.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...cost.capacity import MLP_ROWS
from ...errors import ConfigError
from ...kernels.fp8 import head_amax, scales_for
from ...reduce.ring_prefill import PrefillTiming, RingPlan, ring_prefill_attention
from .hf_attention import CONTEXT_KWARG
from .kv_store import PagedKVShard

__all__ = ["MLP_ROWS", "PrefillReport", "ShardedPrefill", "chunk_mlp", "sharded_prefill"]


@dataclass
class ShardedPrefill:
    """The attention hook's context in a rank's prefill forward: this rank's pool and ring plan.

    ``group``: the process group of the ring (None: the default group); ``timing``: compute and
    wait time, pairs, bytes and messages, summed over the layers."""

    store: PagedKVShard
    plan: RingPlan
    group: Any = None
    timing: PrefillTiming = field(default_factory=PrefillTiming)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One layer: ``query [1, Hq, S_r, D]``, ``key, value [1, Hkv, S_r, D]`` (RoPE applied, this
        rank's tokens in position order). Writes K and V to the pool, returns ``[1, S_r, Hq, D]``."""
        if query.shape[0] != 1:
            raise ConfigError(f"generate prefills one sequence; got a batch of {query.shape[0]}")
        k, v = key[0], value[0]
        if self.store.fp8:
            self.agree_on_scales(layer, k.transpose(0, 1), v.transpose(0, 1))
        if k.shape[1]:
            self.store.write(layer, 0, k.transpose(0, 1), v.transpose(0, 1))
        out, _ = ring_prefill_attention(query[0], k, v, self.plan, scale=scale, group=self.group,
                                        timing=self.timing)
        return out.to(query.dtype).transpose(0, 1).unsqueeze(0)

    def agree_on_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """An fp8 pool: fix layer ``layer``'s scales from the whole prompt's K and V, ``[S_r, Hkv, D]``
        here: each rank's per-head maxima, all-reduced (MAX: exact) over the ring's group, / 448.
        Every rank, one that holds no prompt tokens included, then stores with the same scales, the
        ones a single process would take from the whole prompt, and the reference quantizes its
        cache with them: one all-reduce of ``2 * Hkv`` floats per layer."""
        amax = torch.cat([head_amax(k), head_amax(v)])
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        dtype = self.store.k[layer].dtype
        hkv = k.shape[1]
        self.store.set_scales(layer, scales_for(amax[:hkv], dtype), scales_for(amax[hkv:], dtype))


@dataclass
class PrefillReport:
    """One rank's prefill: its positions' runs, tokens, wall time, and the ring's timing."""

    runs: list[list[int]]
    tokens: int
    wall_s: float
    timing: PrefillTiming

    def to_dict(self) -> dict[str, Any]:
        t = self.timing
        return {"runs": self.runs, "tokens": self.tokens, "wall_s": self.wall_s,
                "attention_compute_s": t.compute_s, "attention_wait_s": t.wait_s, "compute_s": self.wall_s - t.wait_s,
                "pairs_per_head_layer": t.pairs // max(1, t.layers), "bytes_sent": t.stats.bytes_sent,
                "messages": t.stats.messages}


def _chunked_forward(self, x: torch.Tensor, *, forward: Callable, rows: int) -> torch.Tensor:
    """``forward`` (the module's own) over ``x [B, S, H]`` in slices of ``rows`` tokens."""
    if x.shape[1] <= rows:
        return forward(x)
    out = None
    for start in range(0, x.shape[1], rows):
        part = forward(x[:, start:start + rows])
        if out is None:
            out = x.new_empty((*x.shape[:2], part.shape[-1]), dtype=part.dtype)
        out[:, start:start + part.shape[1]] = part
        del part  # not alive beside the next chunk's gate and up (the capacity arithmetic counts one chunk)
    return out


def chunk_mlp(model, rows: int = MLP_ROWS) -> None:
    """Make every decoder layer's MLP run over at most ``rows`` tokens at a time (exact: the MLP is
    token-wise). Its own forward does the work; only the sequence is sliced."""
    for layer in model.base_model.layers:
        mlp = layer.mlp
        if getattr(mlp, "_tree_attn_rows", None) is None:
            original = mlp.forward
            mlp.forward = types.MethodType(
                lambda self, x, _f=original, _r=rows: _chunked_forward(self, x, forward=_f, rows=_r), mlp)
        mlp._tree_attn_rows = rows


@torch.inference_mode()
def sharded_prefill(model, prompt_ids: tuple[int, ...] | list[int], ctx: ShardedPrefill) -> PrefillReport:
    """Prefill this rank's positions of ``prompt_ids[:-1]`` (``ctx.plan``'s) into ``ctx.store``.

    Every rank of the plan's group must call this at the same time: each layer is a ring exchange."""
    plan = ctx.plan
    positions = plan.shards.positions(plan.rank)
    device = ctx.store.block_table.device
    t0 = time.perf_counter()
    if positions:
        ids = torch.tensor([prompt_ids[p] for p in positions], dtype=torch.long, device=device).view(1, -1)
        pos = torch.tensor(positions, dtype=torch.long, device=device).view(1, -1)
        model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **{CONTEXT_KWARG: ctx})
    else:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dtype = next(model.parameters()).dtype
        q = torch.empty((1, heads, 0, head_dim), dtype=dtype, device=device)
        kv = torch.empty((1, kv_heads, 0, head_dim), dtype=dtype, device=device)
        for layer in range(config.num_hidden_layers):
            ctx.attend(layer, q, kv, kv, head_dim ** -0.5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ctx.store.set_length(len(positions))
    runs = [[r.start, r.stop] for r in plan.shards.runs[plan.rank]]
    return PrefillReport(runs, len(positions), time.perf_counter() - t0, ctx.timing)
