"""Rank functions for tests/dist/test_fp8_collectives.py (module level, so spawn can pickle them).

One spawn of 5 CPU ranks covers world sizes 1 to 5: the ranks build one process group per size
(``new_group(range(w))``) and the first w ranks run that size's cases in it. Each rank quantizes
its own shard with its own scales (the scales differ between ranks, so a block that arrived with
the wrong scales shows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.dist.cases import CaseHeads, ShardedCase
from tests.fp8_inputs import quantize
from tests.paged_inputs import to_paged
from tree_attn import ReductionPlan, TreeDecodeStep, ring_decode, tree_decode
from tree_attn.reduce.comm import CommStats
from tree_attn.reduce.ring import RingDecodeStep

MAX_WORLD = 5


@dataclass(frozen=True)
class F8Case(ShardedCase, CaseHeads):
    """A :class:`ShardedCase` (strategy "tree", "allreduce", "ring", "tree-step" or "ring-step")
    whose shards are quantized to float8_e4m3fn per KV head (``per_head``) or with one scalar scale
    (passed as a 0-d tensor, or a Python number when ``number_scales``); q is ``[B, Hq, D]`` when
    sq == 1."""

    per_head: bool = True
    number_scales: bool = False

    def kv_lens(self) -> list[int]:
        """Every rank's KV length as the decode sees it (paged: ``max_blocks * block_size``)."""
        bs = self.block_size
        return [(-(-n // bs) + 1) * bs if bs else n for n in self.shard_lens]

    def inputs(self):
        """q ``[B, Sq, Hq, D]`` bf16 and per rank ``(k8, v8, k_scale, v_scale, lens)`` (contiguous
        fp8, scales float32 [Hkv]), identical in every process. KV head h's values are scaled
        by a per-rank, per-head gain so the scales differ."""
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(self.batch, self.sq, self.q_heads, self.head_dim, generator=g).bfloat16()
        shards = []
        for r, n in enumerate(self.shard_lens):
            # |v| stays below ~4, where the bf16 tolerance's atol bounds out's rounding.
            k_gain = (torch.rand(self.kv_heads, generator=g) * 4 + 0.1)[:, None]
            v_gain = (torch.rand(self.kv_heads, generator=g) * 0.9 + 0.1)[:, None]
            k = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g) * k_gain
            v = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g) * v_gain
            k8, ks = quantize(k, per_head=self.per_head)
            v8, vs = quantize(v, per_head=self.per_head)
            shards.append((k8, v8, ks, vs, torch.tensor(self.valid[r], dtype=torch.int32)))
        return q, shards


def _scales(case: F8Case, ks: torch.Tensor, vs: torch.Tensor):
    if case.per_head:
        return ks, vs
    if case.number_scales:
        return float(ks[0]), float(vs[0])
    return ks[0].clone(), vs[0].clone()


def _call(case: F8Case, group, rank: int, stats: CommStats):
    q, shards = case.inputs()
    k8, v8, ks, vs, lens = shards[rank]
    k_scale, v_scale = _scales(case, ks, vs)
    table = None
    if case.block_size:
        _, _, k8, v8, table = to_paged(k8, v8, case.valid[rank], case.block_size, seed=case.seed + rank)
    qq = q[:, 0] if case.sq == 1 else q
    kw = dict(seq_lens=lens, block_table=table, causal=case.causal, k_scale=k_scale, v_scale=v_scale, group=group)
    if case.strategy == "ring":
        return ring_decode(qq, k8, v8, stats=stats, **kw)
    if case.strategy == "ring-step":  # called twice: the second reuses the receive buffers
        kw.pop("seq_lens")
        step = RingDecodeStep(qq, k8, v8, lens, lengths=case.kv_lens(), **kw)
        step()
        out, lse = step(stats)
        return out.clone(), lse.clone()
    if case.strategy == "tree-step":
        kw.pop("seq_lens")
        with TreeDecodeStep(qq, k8, v8, lens, plan=ReductionPlan("tree", 2), cuda_graph=False, **kw) as step:
            out, lse = step(stats)
            return out.clone(), lse.clone()
    return tree_decode(qq, k8, v8, plan=ReductionPlan(case.strategy, 2), stats=stats, **kw)


def run_fp8_cases(env, cases_by_world: dict[int, list[F8Case]], traffic_cases: dict[int, tuple]):
    """Every size's cases on the first w ranks of a group of w (every rank creates every group,
    as ``new_group`` requires). Then, per size, the ring's traffic for one shape with an fp8
    and with a bf16 cache. Returns ``{w: [(out, lse, (messages, bytes)), ...]}`` and
    ``{w: {"fp8": (messages, bytes), "bfloat16": ...}}`` for this rank (empty where it is not in
    the group)."""
    groups = {w: dist.new_group(list(range(w))) for w in range(1, env.world_size + 1)}
    results, traffic = {}, {}
    for w, cases in cases_by_world.items():
        if env.rank >= w:
            continue
        group = groups[w]
        rank = dist.get_rank(group)
        out = []
        for case in cases:
            stats = CommStats()
            o, lse = _call(case, group, rank, stats)
            out.append((o, lse, (stats.messages, stats.bytes_sent)))
        results[w] = out
        traffic[w] = _ring_traffic(group, rank, *traffic_cases[w])
    return results, traffic


def _ring_traffic(group, rank: int, shard_lens, batch: int, kv_heads: int, head_dim: int):
    """The ring's CommStats for the same shapes, fp8 against bf16: two calls each (the second
    with ``lengths`` known, so without the shape all-gather), and one call of a
    :class:`RingDecodeStep` (``"<dtype>-step"``)."""
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, 8, head_dim, generator=g).bfloat16()
    k = torch.randn(batch, shard_lens[rank], kv_heads, head_dim, generator=g)
    v = torch.randn(batch, shard_lens[rank], kv_heads, head_dim, generator=g)
    k8, ks = quantize(k)
    v8, vs = quantize(v)
    counts = {}
    for name, kk, vv, scales in (("fp8", k8, v8, dict(k_scale=ks, v_scale=vs)),
                                 ("bfloat16", k.bfloat16(), v.bfloat16(), {})):
        first, second = CommStats(), CommStats()
        ring_decode(q, kk, vv, group=group, stats=first, **scales)
        ring_decode(q, kk, vv, group=group, stats=second, lengths=list(shard_lens), **scales)
        counts[name] = ((first.messages, first.bytes_sent), (second.messages, second.bytes_sent))
        step_stats = CommStats()
        RingDecodeStep(q, kk, vv, lengths=list(shard_lens), group=group, **scales)(step_stats)
        counts[f"{name}-step"] = (step_stats.messages, step_stats.bytes_sent)
    return counts
