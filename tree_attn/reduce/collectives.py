"""``tree_decode``: exact decode attention over KV shards spread across a process group.

Every rank computes the attention of the (shared) query against its own KV shard, giving a partial
state ``(o, lse)``; the states are merged across ranks following a :class:`ReductionPlan`, and
every rank ends with the attention over the union of all shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..kernels.dispatch import decode_attention
from ..kernels.shapes import DecodeShape, check_decode_inputs
from . import comm
from .comm import CommStats
from ..merge import merge_partials, sanitize_lse
from .plan import ReductionPlan, ReductionTree, default_plan

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def exchange_shapes(
    q: torch.Tensor, shape: DecodeShape, group, stats: CommStats | None, kv_dtype: torch.dtype
) -> list[int]:
    """All-gather every rank's (B, Hq, Hkv, D, q dtype, KV dtype, N); raise if any but N disagree.

    Returns each rank's KV length N (the ring baseline needs them). One small collective. A KV
    dtype that differs between ranks would make the ring's receive buffers the wrong type (NCCL
    would reinterpret the bytes silently), so it is checked with the rest.
    """
    names = ("B", "Hq", "Hkv", "D", "q dtype", "KV dtype")
    desc = torch.tensor(
        [shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, _DTYPE_CODES[q.dtype], _DTYPE_CODES[kv_dtype], shape.kv_len],
        dtype=torch.int64,
        device=q.device,
    )
    every = comm.all_gather(desc, group, stats).cpu()
    mine = every[dist.get_rank(group)]
    fixed = len(names)
    for r, row in enumerate(every):
        if not torch.equal(row[:fixed], mine[:fixed]):
            diffs = ", ".join(
                f"{n} {_describe_field(n, int(a))} vs {_describe_field(n, int(b))}"
                for n, a, b in zip(names, mine[:fixed], row[:fixed])
                if a != b
            )
            raise DistributedError(
                f"ranks disagree on the query/KV shape: this rank (rank {dist.get_rank(group)}) and rank {r} differ in "
                f"{diffs}; every rank must pass the same q [B, Hq, D] and KV shards with the same B, Hkv, D and dtype"
            )
    return [int(n) for n in every[:, fixed]]


def _describe_field(name: str, value: int) -> str:
    if name.endswith("dtype"):
        for dt, code in _DTYPE_CODES.items():
            if code == value:
                return str(dt).replace("torch.", "")
    return str(value)


def pack_state(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Pack ``o [B, H, D]`` and ``lse [B, H]`` into one float32 message ``[B, H, D + 1]``."""
    return torch.cat([o.float(), lse.float().unsqueeze(-1)], dim=-1).contiguous()


def unpack_state(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[..., :-1], buf[..., -1]


def merge_allreduce(
    o: torch.Tensor, lse: torch.Tensor, group, stats: CommStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 3 of the paper: all-reduce max of lse, then one all-reduce of the packed
    rescaled numerator ``exp(lse - m) * o`` and denominator ``exp(lse - m)``.

    Args: o ``[B, H, D]``, lse ``[B, H]``. Returns float32 ``(out, lse)`` over the whole group.
    """
    lse = sanitize_lse(lse)
    m = lse.clone()
    comm.all_reduce(m, dist.ReduceOp.MAX, group, stats)
    # Rows empty on every rank have m = -inf: shift by 0 there so the weights are 0, not NaN.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # 0 for empty local states
    num = torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * o.float(), 0.0)
    buf = pack_state(num, w)
    comm.all_reduce(buf, dist.ReduceOp.SUM, group, stats)
    num, den = unpack_state(buf)
    nonempty = den > 0
    safe_den = torch.where(nonempty, den, torch.ones_like(den))
    out = torch.where(nonempty.unsqueeze(-1), num / safe_den.unsqueeze(-1), 0.0)
    lse_out = torch.where(nonempty, m + torch.log(safe_den), float("-inf"))
    return out, lse_out


def merge_tree(
    o: torch.Tensor, lse: torch.Tensor, tree: ReductionTree, group, stats: CommStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge up an explicit tree of point-to-point messages, then send the result back down.

    Each non-root rank sends one ``[B, H, D + 1]`` float32 message up and receives one down; a
    node's children are received concurrently and merged in one exact merge with its own state.
    """
    rank = dist.get_rank(group)
    children = tree.children[rank]
    parent = tree.parent[rank]
    mine = pack_state(o, lse)
    if children:
        bufs = [torch.empty_like(mine) for _ in children]
        reqs = [comm.irecv(b, c, group) for b, c in zip(bufs, children)]
        comm.wait_all(reqs, f"tree reduce: receive from children {list(children)}")
        states = torch.stack([mine, *bufs])
        out, lse_m = merge_partials(states[..., :-1], states[..., -1])
        mine = pack_state(out, lse_m)
    if parent >= 0:
        comm.wait_all([comm.isend(mine, parent, group, stats)], f"tree reduce: send to parent {parent}")
        comm.wait_all([comm.irecv(mine, parent, group)], f"tree broadcast: receive from parent {parent}")
    if children:
        reqs = [comm.isend(mine, c, group, stats) for c in children]
        comm.wait_all(reqs, f"tree broadcast: send to children {list(children)}")
    out, lse_out = unpack_state(mine)
    return out, lse_out


def tree_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    group=None,
    plan: ReductionPlan | None = None,
    impl: str = "auto",
    config=None,
    check_shapes: bool = True,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-attention decoding: a collective over ``group`` (default: the world).

    Args:
        q: ``[B, Hq, D]``, the same on every rank.
        k, v: this rank's KV shard ``[B, N_r, Hkv, D]``; N_r may differ per rank and may be 0.
        seq_lens: optional int ``[B]``: valid keys of this rank's shard per row (0..N_r).
        scale: softmax scale (default ``D ** -0.5``).
        plan: the reduction plan (default :func:`reduce.plan.default_plan`).
        impl, config: passed to :func:`decode_attention` for the local shard.
        check_shapes: all-gather a shape descriptor first and raise :class:`DistributedError` if
            ranks disagree (one tiny extra collective; every rank must pass the same value).
        stats: a :class:`CommStats` to count this rank's messages and bytes into.

    Returns:
        ``out [B, Hq, D]`` in q's dtype and ``lse [B, Hq]`` float32: attention over the union of
        all ranks' keys, identical on every rank.
    """
    comm.require_initialized()
    shape = check_decode_inputs(q, k, v, seq_lens)
    world = dist.get_world_size(group)
    plan = plan or default_plan(world)
    plan.check(world)
    if check_shapes:
        exchange_shapes(q, shape, group, stats, k.dtype)
    o, lse = decode_attention(q, k, v, seq_lens=seq_lens, scale=scale, impl=impl, config=config)
    if q.numel() == 0:
        return o, lse
    if plan.strategy == "allreduce":
        out, lse = merge_allreduce(o, lse, group, stats)
    else:
        out, lse = merge_tree(o, lse, plan.tree(world), group, stats)
    return out.to(q.dtype).contiguous(), lse.contiguous()
