"""``ring_decode``: the Ring Attention baseline for decoding, as the paper compares against.

KV blocks travel around the ring: in each of ``p - 1`` steps every rank forwards the block it holds
to its successor while computing attention on it, and receives its predecessor's block; each
arriving block's state is merged into the running state. Sends and receives overlap the compute.
Per decode step each rank sends ``p - 1`` whole KV shards: volume linear in the sequence length,
against the tree's ``O(B * Hq * D)`` messages independent of it.

A paged shard is read in place for this rank's own block; the copy that travels is its pages
gathered into a contiguous ``[B, max_blocks * block_size, Hkv, D]`` block (``kernels.paged``).
Under ``causal`` the new tokens' KV is on the last rank (as in ``tree_decode``), and only the
block that came from rank ``world_size - 1`` is computed with the causal mask. Whether a block is
that one is not sent with it: at step s every rank holds rank ``rank - s``'s block (the ring's
order is fixed), so each rank knows it without an extra message or a host read of a flag (which
on GPUs would sync every step).

An fp8 shard travels as it is stored, 1 byte per element (half a bf16 shard's bytes), with its
dequantization scales: each block's ``k_scale`` and ``v_scale`` (float32 ``[Hkv]``, the block
owner's: ranks may quantize their shards apart) go with it as one more message of ``8 * Hkv``
bytes per step, counted in :class:`CommStats` like the rest. The bytes go as ``uint8`` views
(the backends' send/receive need not know fp8 dtypes: gloo has none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError, TreeAttnError
from ..graphs import persistent_buffers
from ..kernels.fp8 import check_scale_values, expand_scale, is_fp8, scale_form
from ..kernels.impl import resolve_impl
from ..kernels.layout import FLOAT32
from ..kernels.paged import gather_pages
from ..kernels.prepared import DecodeOptions, PreparedDecode, prepared_decode
from ..kernels.shapes import check_decode_inputs
from . import comm
from .collectives import check_new_tokens, exchange_shapes
from .comm import CommStats
from .state import merge_two


def ring_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, group=None, impl: str = "auto",
    config=None, lengths: Sequence[int] | None = None, stats: CommStats | None = None,
    block_table: torch.Tensor | None = None, causal: bool = False, k_scale=None, v_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring Attention decoding; same contract as :func:`tree_decode`.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]``, the same on every rank; k, v: this rank's shard
            ``[B, N_r, Hkv, D]``, or its paged pools with ``block_table``.
        seq_lens: optional int ``[B]`` valid keys of this rank's shard per row (required when paged).
        lengths: every rank's shard length ``N_r`` (paged: ``max_blocks * block_size``), in
            group-rank order, if already known (a decode loop learns them once); ``None`` =
            all-gather them, and check that the ranks' shapes agree, first (one small collective
            and a host sync per call).
        block_table, causal: as in :func:`tree_decode` (the new tokens' KV on the last rank).
        k_scale, v_scale: this rank's scales for an fp8 shard (as in :func:`tree_decode`); they
            travel with its blocks.

    Returns:
        ``out`` in q's dtype and shape and ``lse`` float32 (``[B, (Sq,) Hq]``) over all ranks' keys.
    """
    comm.require_initialized()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shape = None
    try:
        # The local kernel's options, checked before anything is sent: float32 partials (no rounding
        # to q's dtype before the merge), the causal mask on one block only.
        plain_opts = DecodeOptions(scale, impl, config, FLOAT32).checked()
        causal_opts = plain_opts._replace(causal=True)
        shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        resolve_impl(impl, q.device)
        scale_form(k.dtype, k_scale, v_scale, shape.kv_heads, k.device)  # missing/unexpected/ill-formed scales
        fp8 = is_fp8(k.dtype)
        if fp8:  # this rank's scales as one float32 [2, Hkv] tensor: what travels with its block
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if isinstance(s, torch.Tensor):
                    check_scale_values(name, s)
            cur_scales = torch.stack([expand_scale(k_scale, shape.kv_heads, k.device),
                                      expand_scale(v_scale, shape.kv_heads, k.device)])
        else:
            cur_scales = None
        if causal and rank == world - 1 and (lengths is None or q.device.type == "cpu"):
            # Reads seq_lens on the host: on GPUs only in a call that syncs anyway (the shape
            # exchange); a loop that passes ``lengths`` checked them in its first call.
            check_new_tokens(q, k, seq_lens, group)
        refused = None
    except TreeAttnError as exc:
        if lengths is not None:  # no exchange to tell the other ranks through
            raise
        refused, shape = exc, None
    # Block sizes differ per rank; every rank learns them (and checks the shapes agree) up front.
    # A rank whose checks refused its call still joins the exchange, so every rank raises.
    if lengths is None:
        lengths = exchange_shapes(q, shape, group, stats, None if refused is not None else k.dtype, causal, refused)
    else:
        lengths = [int(n) for n in lengths]
        if len(lengths) != world or lengths[rank] != shape.kv_len:
            raise DistributedError(
                f"ring_decode: lengths={lengths} must list {world} shard lengths with this rank's "
                f"(rank {rank}) equal to its KV length {shape.kv_len}"
            )
    b = shape.batch
    if seq_lens is None:
        seq_lens = torch.full((b,), shape.kv_len, dtype=torch.int32, device=q.device)
    cur_len = seq_lens.to(torch.int32).contiguous()
    if block_table is None:
        cur_k, cur_v = k.contiguous(), v.contiguous()
    elif world > 1:  # what travels: the shard's pages, gathered (this rank's own block is read in place)
        cur_k, cur_v = gather_pages(k, block_table, cur_len), gather_pages(v, block_table, cur_len)
    else:  # nothing travels
        cur_k = cur_v = None
    out = lse = None

    def wire(t: torch.Tensor) -> torch.Tensor:  # what a send or receive takes: fp8 bytes as uint8
        return t.view(torch.uint8) if fp8 else t

    succ, pred = (rank + 1) % world, (rank - 1) % world
    for step in range(world):
        reqs: list = []
        if step < world - 1:
            src = (rank - step - 1) % world  # whose block arrives in this step
            n_src = lengths[src]
            nxt_k = torch.empty((b, n_src, shape.kv_heads, shape.head_dim), dtype=k.dtype, device=k.device)
            nxt_v = torch.empty_like(nxt_k)
            nxt_len = torch.empty((b,), dtype=torch.int32, device=q.device)
            # Block being forwarded this step came from rank (rank - step); an empty one is not sent
            # (both ends know its length), only its per-row lengths are (and an fp8 block's scales).
            fwd_len = lengths[(rank - step) % world]
            sends = [(cur_len, succ)] + ([(wire(cur_k), succ), (wire(cur_v), succ)] if fwd_len > 0 else [])
            recvs = [(nxt_len, pred)] + ([(wire(nxt_k), pred), (wire(nxt_v), pred)] if n_src > 0 else [])
            if fp8:
                nxt_scales = torch.empty_like(cur_scales)
                sends.append((cur_scales, succ))
                recvs.append((nxt_scales, pred))
            reqs = comm.batch_p2p(sends, recvs, group, stats)
        # Compute on the block in hand while it travels on; float32 partials (no rounding to q's
        # dtype before the merge), the local kernel resolved once per block shape. The block in
        # hand came from rank (rank - step): the causal one iff that is the last rank.
        blk_causal = causal and (rank - step) % world == world - 1
        opts = causal_opts if blk_causal else plain_opts
        scales = {} if not fp8 else {"k_scale": cur_scales[0], "v_scale": cur_scales[1]}
        if step == 0 and block_table is not None:
            local = prepared_decode(q, k, v, seq_lens, block_table=block_table, options=opts, **scales)
            o_blk, lse_blk = local(q, k, v, seq_lens, block_table=block_table, **scales)
        else:
            local = prepared_decode(q, cur_k, cur_v, cur_len, options=opts, **scales)
            o_blk, lse_blk = local(q, cur_k, cur_v, cur_len, **scales)
        if out is None:
            out, lse = o_blk, lse_blk
        else:
            out, lse = merge_two(out, lse, o_blk, lse_blk)
        if reqs:
            comm.wait_all(reqs, f"ring step {step}: exchange with ranks {pred} and {succ}",
                          [f"to rank {succ}"] * len(sends) + [f"from rank {pred}"] * len(recvs))
            cur_k, cur_v, cur_len = nxt_k, nxt_v, nxt_len
            if fp8:
                cur_scales = nxt_scales
    return out.to(q.dtype).contiguous(), lse.contiguous()


class RingDecodeStep:
    """:func:`ring_decode` prepared once on static tensors: ``out, lse = step(stats)``.

    For decode loops (``generate``'s layers): built from the tensors the loop updates in place
    (``q``, this rank's ``k``/``v`` or paged pools with ``block_table``, ``seq_lens``, an fp8
    shard's ``k_scale``/``v_scale``) and every rank's shard length ``lengths`` (paged:
    ``max_blocks * block_size``), it checks the shapes and the scales' form once (and, on the last
    rank under ``causal``, that its shard holds the new tokens), resolves one local kernel per ring
    step (each source rank's block has its own length) and allocates the receive buffers, two
    sets of the longest shard's size used in turn. A call then gathers its own pages (what
    travels), exchanges blocks around the ring and merges, as :func:`ring_decode` does, without a
    cache look-up, a shape check or a receive allocation. It stays eager on GPUs: whole shards
    travel each step (see ``commands/run``'s reason). The received lengths (and scales) are
    checked on every call on CPU ranks (they come from a peer).

    An fp8 shard travels as :func:`ring_decode` sends it: its bytes as ``uint8``, and with each
    block its owner's scales (float32 ``[2, Hkv]``, one more message of ``8 * Hkv`` bytes per
    ring step, counted in ``stats``), read from ``k_scale``/``v_scale`` at every call (they may
    be updated in place). Each received block is computed with the scales that came with it:
    ranks quantize their shards apart.

    Building is local (no collective): every rank must pass the same ``lengths``.
    """

    @persistent_buffers()
    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
        *, lengths: Sequence[int], scale: float | None = None, group=None, impl: str = "auto", config=None,
        block_table: torch.Tensor | None = None, causal: bool = False, k_scale=None, v_scale=None,
    ) -> None:
        comm.require_initialized()
        shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        lengths = [int(n) for n in lengths]
        if len(lengths) != world or lengths[rank] != shape.kv_len:
            raise DistributedError(
                f"RingDecodeStep: lengths={lengths} must list {world} shard lengths with this rank's "
                f"(rank {rank}) equal to its KV length {shape.kv_len}"
            )
        if causal and rank == world - 1:
            check_new_tokens(q, k, seq_lens, group)  # once, here
        b, hkv, d = shape.batch, shape.kv_heads, shape.head_dim
        self.group, self.world, self.rank, self.lengths = group, world, rank, lengths
        self.succ, self.pred = (rank + 1) % world, (rank - 1) % world
        self.q, self.k, self.v, self.block_table = q, k, v, block_table
        self.k_scale, self.v_scale = k_scale, v_scale
        self.out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        self.lens = seq_lens if seq_lens is not None else torch.full((b,), shape.kv_len, dtype=torch.int32,
                                                                    device=q.device)
        self._own_lens = torch.empty(b, dtype=torch.int32, device=q.device)  # what is sent: int32
        opts = DecodeOptions(scale, impl, config, FLOAT32)
        # Step 0: this rank's own block, read in place; step s > 0: the block of rank (rank - s).
        # The local kernel checks the scales' form (and, on GPUs, their values) here, once.
        self.local = PreparedDecode(q, k, v, seq_lens, block_table=block_table, check_values=False,
                                    options=opts._replace(causal=causal and rank == world - 1),
                                    k_scale=k_scale, v_scale=v_scale)
        self.fp8 = self.local.scales.fp8
        travel = world > 1 and self.fp8
        # What travels with this rank's block: its scales [2, Hkv], refreshed at every call.
        self._own_scales = torch.empty((2, hkv), dtype=torch.float32, device=k.device) if travel else None
        longest = max(lengths)
        per = b * hkv * d
        # Received scales start at 1, not garbage: a GPU kernel checks its scales' values once, when
        # it is built here (the peer's arrive before every use).
        self._bufs = [(torch.empty(longest * per, dtype=k.dtype, device=k.device),
                       torch.empty(longest * per, dtype=k.dtype, device=k.device),
                       torch.zeros(b, dtype=torch.int32, device=q.device),
                       torch.ones((2, hkv), dtype=torch.float32, device=k.device) if travel else None)
                      for _ in range(2 if world > 1 else 0)]
        # per ring step s = 1..world-1: (kernel, k view, v view, lens, scales) of rank (rank - s)'s block
        self._steps = []
        for s in range(1, world):
            src = (rank - s) % world
            kb, vb, lb, sb = self._bufs[(s - 1) % 2]
            n = lengths[src]
            kv = (kb[: n * per].view(b, n, hkv, d), vb[: n * per].view(b, n, hkv, d))
            scales = {"k_scale": sb[0], "v_scale": sb[1]} if travel else {}
            kernel = PreparedDecode(q, *kv, lb, options=opts._replace(causal=causal and src == world - 1), **scales)
            self._steps.append((kernel, *kv, lb, sb))

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """What a send or receive takes: fp8 bytes as uint8 (gloo has no fp8 dtypes)."""
        return t.view(torch.uint8) if self.fp8 else t

    def __call__(self, stats: CommStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        world, rank, q, wire = self.world, self.rank, self.q, self._wire
        self._own_lens.copy_(self.lens)
        if self.world == 1:
            cur = None
        elif self.block_table is None:
            cur = (self.k.contiguous(), self.v.contiguous(), self._own_lens, self._own_scales)
        else:  # what travels: the shard's pages, gathered
            cur = (gather_pages(self.k, self.block_table, self._own_lens),
                   gather_pages(self.v, self.block_table, self._own_lens), self._own_lens, self._own_scales)
        if self._own_scales is not None:  # this call's scales (CPU: their values checked), as they travel
            ks, vs = self.local.scales(self.k_scale, self.v_scale)
            self._own_scales[0].copy_(ks)
            self._own_scales[1].copy_(vs)
        out, lse = self.local(q, self.k, self.v, self.lens, block_table=self.block_table,
                              k_scale=self.k_scale, v_scale=self.v_scale)
        for step in range(world):
            reqs: list = []
            if step < world - 1:
                src = (rank - step - 1) % world  # whose block arrives in this step
                _, nxt_k, nxt_v, nxt_len, nxt_scales = self._steps[step]
                fwd_len = self.lengths[(rank - step) % world]
                # As ring_decode: lengths, K and V unless the block is empty, an fp8 block's scales.
                sends = [(cur[2], self.succ)] + ([(wire(cur[0]), self.succ), (wire(cur[1]), self.succ)]
                                                 if fwd_len > 0 else [])
                recvs = [(nxt_len, self.pred)] + ([(wire(nxt_k), self.pred), (wire(nxt_v), self.pred)]
                                                  if self.lengths[src] > 0 else [])
                if nxt_scales is not None:
                    sends.append((cur[3], self.succ))
                    recvs.append((nxt_scales, self.pred))
                reqs = comm.batch_p2p(sends, recvs, self.group, stats)
            if step > 0:  # the block in hand came from rank (rank - step), with its owner's scales
                kernel, blk_k, blk_v, blk_len, blk_scales = self._steps[step - 1]
                scales = {} if blk_scales is None else {"k_scale": blk_scales[0], "v_scale": blk_scales[1]}
                o_blk, lse_blk = kernel(q, blk_k, blk_v, blk_len, **scales)
                out, lse = merge_two(out, lse, o_blk, lse_blk)
            if reqs:
                comm.wait_all(reqs, f"ring step {step}: exchange with ranks {self.pred} and {self.succ}",
                              [f"to rank {self.succ}"] * len(sends) + [f"from rank {self.pred}"] * len(recvs))
                cur = self._steps[step][1:]
        self.out.copy_(out)
        self.lse.copy_(lse)
        return self.out, self.lse
