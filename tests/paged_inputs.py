"""Test inputs in the paged layout, and a float64 truth for several query tokens over KV shards.

:func:`to_paged` scatters a contiguous cache into a shuffled pool (pages in random order, spare
blocks, entries past a row's last page set to -1, optionally two rows sharing a page), filling
everything a kernel must not read with NaN: a kernel that reads a wrong page or past a row's
length gives NaN, never a plausible number. :func:`float64_over_shards` is written from the
definition (token i sees every earlier shard and the last shard's first ``len - Sq + 1 + i``
keys), independently of ``tree_attn.kernels.reference``.
"""

from __future__ import annotations

import torch


def to_paged(k, v, lens, block_size: int, *, seed: int = 0, share: bool = False, spare: int = 2, pad: int = -1):
    """Scatter ``k, v [B, N, Hkv, D]`` (valid lengths ``lens``) into pools with a shuffled table.

    Returns ``(k, v, k_pool, v_pool, block_table)``: the contiguous truth (rows 0 and 1 share
    their first page when ``share``, so row 1's first ``block_size`` tokens are row 0's),
    ``[num_blocks, block_size, Hkv, D]`` pools and an int32 ``[B, ceil(N / block_size) + 1]``
    table (one extra column, and every entry past a row's needed pages, holds ``pad``).
    """
    g = torch.Generator().manual_seed(seed)
    b, n, hkv, d = k.shape
    lens = [int(x) for x in lens]
    k, v = k.clone(), v.clone()
    max_blocks = -(-n // block_size) + 1
    needed = [-(-length // block_size) for length in lens]
    shared = share and b >= 2 and needed[0] >= 1 and needed[1] >= 1
    if shared:
        k[1, :block_size] = k[0, :block_size]
        v[1, :block_size] = v[0, :block_size]
    pages = [(row, p) for row in range(b) for p in range(needed[row]) if not (shared and row == 1 and p == 0)]
    num_blocks = len(pages) + spare
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_pool = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=k.dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.full((b, max_blocks), pad, dtype=torch.int32)
    for (row, p), blk in zip(pages, order):
        table[row, p] = blk
        t0, t1 = p * block_size, min(lens[row], (p + 1) * block_size)  # past the row's length: NaN
        k_pool[blk, : t1 - t0] = k[row, t0:t1]
        v_pool[blk, : t1 - t0] = v[row, t0:t1]
    if shared:
        table[1, 0] = table[0, 0]
        # The shared page holds row 0's tokens: row 1 reads as many of them as its length asks.
        t1 = min(block_size, max(lens[0], lens[1]))
        k_pool[table[0, 0], :t1] = k[0, :t1]
        v_pool[table[0, 0], :t1] = v[0, :t1]
    return k, v, k_pool, v_pool, table


def float64_over_shards(q, shards, causal: bool):
    """Attention of ``q [B, Sq, Hq, D]`` over the union of ``shards`` (a list of contiguous
    ``(k [B, N_r, Hkv, D], v, lens [B])``), float64. Under ``causal`` the new tokens are the last
    Sq valid keys of the last shard: token i sees every valid key of the other shards and the
    last shard's first ``lens - Sq + 1 + i``. Returns ``out [B, Sq, Hq, D]``, ``lse [B, Sq, Hq]``."""
    b, sq, hq, d = q.shape
    hkv = shards[0][0].shape[2]
    masks, ks, vs = [], [], []
    for r, (kk, vv, lens) in enumerate(shards):
        n = kk.shape[1]
        pos = torch.arange(n)[None, None, :]
        limit = lens.to(torch.int64)[:, None, None].expand(b, sq, 1)
        if causal and r == len(shards) - 1:
            limit = limit - (sq - 1) + torch.arange(sq)[None, :, None]
        masks.append(pos < limit)  # [B, Sq, N_r]
        ks.append(kk.double())
        vs.append(torch.where((torch.arange(n)[None, :] < lens[:, None])[:, :, None, None], vv.double(), 0.0))
    mask = torch.cat(masks, -1)
    k, v = torch.cat(ks, 1), torch.cat(vs, 1)
    qd = q.double().view(b, sq, hkv, hq // hkv, d) * d**-0.5
    s = torch.einsum("bshgd,bnhd->bshgn", qd, k).masked_fill(~mask[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bshgn,bnhd->bshgd", p, v)
    return out.reshape(b, sq, hq, d), lse.reshape(b, sq, hq)
