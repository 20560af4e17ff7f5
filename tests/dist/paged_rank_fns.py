"""Rank functions for tests/dist/test_paged_multitoken.py (module level, so spawn can pickle them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.dist.cases import PlanCase, ShardedCase
from tests.paged_inputs import to_paged
from tree_attn import ReductionPlan, ShapeError, TreeDecodeStep, ring_decode, tree_decode


@dataclass(frozen=True)
class MTCase(ShardedCase, PlanCase):
    """A :class:`ShardedCase` (strategy "tree", "allreduce" or "ring") in the plan's dtype; a
    ``[B, Hq, D]`` query when ``q3``."""

    q3: bool = False

    def inputs(self):
        """q ``[B, Sq, Hq, D]`` and every rank's ``(k, v, lens, k_pool, v_pool, table)``
        (contiguous truth, and the pools when paged), identical in every process."""
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(self.batch, self.sq, self.q_heads, self.head_dim, generator=g).to(self.dtype)
        shards = []
        for r, n in enumerate(self.shard_lens):
            k = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            v = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            lens = torch.tensor(self.valid[r], dtype=torch.int32)
            pools = (None, None, None)
            if self.block_size:
                k, v, kp, vp, table = to_paged(k, v, self.valid[r], self.block_size, seed=self.seed + r, share=r == 0)
                pools = (kp, vp, table)
            shards.append((k, v, lens, *pools))
        return q, shards


def _call(case: MTCase, q, shard, dev):
    k, v, lens, kp, vp, table = (None if t is None else t.to(dev) for t in shard)
    if case.block_size:
        k, v = kp, vp
    q = q.to(dev)
    qq = q[:, 0] if case.q3 else q
    kw = dict(seq_lens=lens, block_table=table, causal=case.causal)
    if case.strategy == "ring":
        return ring_decode(qq, k, v, **kw)
    return tree_decode(qq, k, v, plan=ReductionPlan(case.strategy, case.fanout, rank_order=case.rank_order), **kw)


def _cpu(state):
    return tuple(t.to("cpu", copy=True) for t in state)


def run_mt_cases(env, cases: list[MTCase], step_case: MTCase | None):
    """Every case on this rank, then (``step_case``) a TreeDecodeStep loop for tree and allreduce,
    then, at world size 1 on CPU ranks, the short-shard error. Runs on CPU ranks or on one GPU per
    rank (``env.device``). Returns ``(results, steps, error text)``, tensors on the CPU."""
    dev = torch.device(env.device)
    results = [_cpu(_call(case, *_rank_inputs(case, env.rank), dev)) for case in cases]
    steps = {}
    if step_case is not None:
        for strategy in ("tree", "allreduce"):
            steps[strategy] = _step_loop(env, step_case, strategy)
    error = None
    if env.world_size == 1 and dev.type == "cpu":
        _q, shard = _rank_inputs(cases[0], 0)
        k, v = shard[0], shard[1]
        short = torch.tensor([k.shape[1], 2], dtype=torch.int32)  # row 1 holds 2 keys, Sq is 3
        try:
            tree_decode(torch.zeros(2, 3, 8, 16), k[:2], v[:2], seq_lens=short, causal=True)
        except ShapeError as exc:
            error = str(exc)
    return results, steps, error


def _rank_inputs(case: MTCase, rank: int):
    q, shards = case.inputs()
    return q, shards[rank]


def _step_loop(env, case: MTCase, strategy: str):
    """TreeDecodeStep on static buffers (paged, causal): between steps the query changes, the last
    rank's lengths grow (the new tokens land there) and the block tables are rewritten (rows'
    pages swapped). Returns per step the query, the lengths every rank used, whether the rows were
    swapped, and (out, lse); and whether the step replayed a CUDA graph."""
    dev = torch.device(env.device)
    q, shards = case.inputs()
    k, v, lens = shards[env.rank][:3]
    # Every token of the shard paged (the lengths grow into them), the truth unchanged (no sharing).
    _, _, kp, vp, table = to_paged(k, v, [k.shape[1]] * case.batch, case.block_size, seed=case.seed + 50 + env.rank)
    q_buf, lens_buf, table_buf = (t.to(dev, copy=True) for t in (q, lens, table))
    kp, vp, table = kp.to(dev), vp.to(dev), table.to(dev)
    g = torch.Generator().manual_seed(case.seed + 100)
    history = []
    all_lens = [s[2].clone() for s in shards]
    last = env.world_size - 1
    # Closed on leaving (its graph, holding NCCL kernels, must not outlive the process group).
    with TreeDecodeStep(q_buf, kp, vp, lens_buf, plan=ReductionPlan(strategy, case.fanout),
                        block_table=table_buf, causal=case.causal) as step:
        for s in range(3):
            q_buf.copy_(torch.randn(q.shape, generator=g))
            all_lens[last] = torch.clamp(all_lens[last] + 1, max=case.shard_lens[last])
            if s == 2:  # both rows' pages swapped in every rank's table, and their lengths with them
                all_lens = [t.flip(0) for t in all_lens]
                table_buf.copy_(table.flip(0))
            lens_buf.copy_(all_lens[env.rank])
            out, lse = step()
            history.append((*_cpu((q_buf,)), [t.clone() for t in all_lens], s == 2, *_cpu((out, lse))))
        captured = step.captured
    return history, captured


def short_last_shard(env):
    """Causal with 4 new tokens, but the last rank's row 0 holds only 3 keys: the last rank must
    raise (and the others with it: the shape exchange of the first call tells them)."""
    q = torch.zeros(1, 4, 4, 16)
    n = 3 if env.rank == env.world_size - 1 else 6
    k = torch.zeros(1, n, 2, 16)
    return tree_decode(q, k, k, causal=True)
