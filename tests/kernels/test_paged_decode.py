"""Paged KV caches and several query tokens per row, on one device: the torch paths (CPU fast path
and float64 reference), and the Triton kernel (on the GPU if there is one, else in Triton's CPU
interpreter, see conftest.py), each against float64 on ``out`` and ``lse``.

Pools come from ``tests/paged_inputs.to_paged``: shuffled pages, spare blocks, -1 past each row's
pages, NaN wherever a kernel must not read. Shapes stay small for the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.paged_inputs import float64_over_shards, to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn import DecodeStep, decode_attention
from tree_attn.errors import ConfigError, ShapeError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.paged import check_block_table, gather_pages
from tree_attn.kernels.reference import decode_attention_float64


def _inputs(b, sq, hq, hkv, d, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype)
    return q, k, v


def _truth(q, k, v, lens, causal):
    """float64 over the contiguous cache, from the definition (tests/paged_inputs.py)."""
    return float64_over_shards(q, [(k, v, lens)], causal)


def _impls(device):
    """(impl, config, device): the torch path on CPU tensors (on GPU machines too), and the Triton
    kernel with a small explicit config where this process runs Triton (GPU, or interpreter)."""
    return [("torch", None, torch.device("cpu")),
            ("triton", DecodeConfig(block_n=16, num_splits=2), torch.device(device))]


# name -> (B, Hq, Hkv, D, N, lens, share): GQA, D=80, rows of length 0, a shared page.
PAGED_CASES = {
    "gqa4_len0_row": (3, 8, 2, 16, 37, [37, 0, 20], False),
    "d80_mha_shared_page": (2, 2, 2, 80, 35, [35, 23], True),
}


@pytest.mark.parametrize("block_size", [1, 3, 16, 17, 256])
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_equals_contiguous(case, block_size, device):
    b, hq, hkv, d, n, lens, share = PAGED_CASES[case]
    if block_size == 256:
        n = 300  # two pages per full row
        lens = [min(300, x * 8) for x in lens]
    q, k, v = _inputs(b, 1, hq, hkv, d, n, seed=block_size)
    k, v, kp, vp, table = to_paged(k, v, lens, block_size, seed=block_size, share=share)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref_out, ref_lse = _truth(q, k, v, sl, False)
    q3 = q[:, 0]
    for impl, config, dev in _impls(device):
        args = [t.to(dev) for t in (q3, k, v, sl, kp, vp, table)]
        q_, k_, v_, sl_, kp_, vp_, table_ = args
        tol = tol_for(torch.float32, device=dev)
        out, lse = decode_attention(q_, kp_, vp_, seq_lens=sl_, block_table=table_, impl=impl, config=config)
        assert out.shape == (b, hq, d) and lse.shape == (b, hq)
        assert_decode_close(out, lse, ref_out[:, 0], ref_lse[:, 0], tol,
                            what=f"{impl} paged bs={block_size} vs float64")
        c_out, c_lse = decode_attention(q_, k_, v_, seq_lens=sl_, impl=impl, config=config)
        assert_decode_close(out, lse, c_out, c_lse, tol, what=f"{impl} paged bs={block_size} vs contiguous")


def test_paged_bf16_and_fp16(device):
    """16-bit pools: the same tokens paged and contiguous, both against float64."""
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _inputs(2, 1, 8, 2, 16, 40, dtype, seed=3)
        lens = [40, 9]
        k, v, kp, vp, table = to_paged(k, v, lens, 16, seed=3)
        sl = torch.tensor(lens, dtype=torch.int32)
        ref_out, ref_lse = _truth(q, k, v, sl, False)
        for impl, config, dev in _impls(device):
            out, lse = decode_attention(q[:, 0].to(dev), kp.to(dev), vp.to(dev), seq_lens=sl.to(dev),
                                        block_table=table.to(dev), impl=impl, config=config)
            assert out.dtype == dtype
            assert_decode_close(out, lse, ref_out[:, 0], ref_lse[:, 0], tol_for(dtype, device=dev),
                                what=f"{impl} {dtype}")


@pytest.mark.parametrize("block_size,block_n", [(1, 16), (16, 16), (17, 16), (32, 32)])
def test_paged_fp32_with_the_h100_default_config(block_size, block_n, device):
    """fp32 pools run with the config an H100 launch of this shape picks (kernels.config): 16-key
    tiles in 16-token pages read one block id per tile (32-key tiles gathered key by key spilled
    registers), per-key gathers at 1 and 17 tokens, 32-key tiles in 32-token pages; against float64."""
    from tree_attn.cost.devices import KNOWN_DEVICES
    from tree_attn.kernels.config import default_config
    from tree_attn.kernels.shapes import DecodeShape

    b, hq, hkv, d, n = 2, 8, 2, 128, 90
    lens = [90, 41]
    q, k, v = _inputs(b, 1, hq, hkv, d, n, seed=40 + block_size)
    k, v, kp, vp, table = to_paged(k, v, lens, block_size, seed=block_size)
    sl = torch.tensor(lens, dtype=torch.int32)
    shape = DecodeShape(b, hq, hkv, d, table.shape[1] * block_size, block_size=block_size, num_blocks=kp.shape[0])
    config = default_config(shape, torch.float32, KNOWN_DEVICES["h100-sxm"])
    assert config.block_n == block_n, config
    ref_out, ref_lse = _truth(q, k, v, sl, False)
    out, lse = decode_attention(q[:, 0].to(device), kp.to(device), vp.to(device), seq_lens=sl.to(device),
                                block_table=table.to(device), impl="triton", config=config)
    assert_decode_close(out, lse, ref_out[:, 0], ref_lse[:, 0], tol_for(torch.float32, device=device),
                        what=f"fp32 paged bs={block_size} {config.describe()}")


# (Sq, causal, paged block size or None): Sq 1, 2, 5, 16, with and without causal, contiguous and paged.
MULTI_CASES = [
    (1, False, None), (1, True, 3), (2, True, None), (2, False, 17), (5, True, 16), (5, False, None),
    (16, True, None), (16, True, 3), (16, False, 16),
]


@pytest.mark.parametrize("sq,causal,block_size", MULTI_CASES,
                         ids=[f"sq{s}-{'causal' if c else 'full'}-{'bs' + str(b) if b else 'contig'}"
                              for s, c, b in MULTI_CASES])
def test_several_query_tokens(sq, causal, block_size, device):
    """q [B, Sq, Hq, D] against float64 for out and lse; rows shorter than Sq (some tokens see
    nothing under causal), a row of length 0, GQA 4."""
    b, hq, hkv, d, n = 3, 8, 2, 16, 30
    lens = [30, 0, 3]
    q, k, v = _inputs(b, sq, hq, hkv, d, n, seed=sq + 7 * causal)
    sl = torch.tensor(lens, dtype=torch.int32)
    if block_size:
        k, v, kp, vp, table = to_paged(k, v, lens, block_size, seed=sq)
    ref_out, ref_lse = _truth(q, k, v, sl, causal)
    for impl, config, dev in _impls(device):
        kw = dict(seq_lens=sl.to(dev), impl=impl, config=config, causal=causal)
        if block_size:
            out, lse = decode_attention(q.to(dev), kp.to(dev), vp.to(dev), block_table=table.to(dev), **kw)
        else:
            out, lse = decode_attention(q.to(dev), k.to(dev), v.to(dev), **kw)
        assert out.shape == (b, sq, hq, d) and lse.shape == (b, sq, hq)
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=dev),
                            what=f"{impl} sq={sq} causal={causal}")


def test_multi_token_triton_group_blocks_and_splits(device):
    """Sq x group past 64 rows (two row blocks per KV head: MQA 16 heads x 5 tokens), D=80,
    many splits, bf16, causal, paged with pages shorter than a tile."""
    q, k, v = _inputs(2, 5, 16, 1, 80, 45, torch.bfloat16, seed=9)
    lens = [45, 6]
    k, v, kp, vp, table = to_paged(k, v, lens, 5, seed=9)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref_out, ref_lse = _truth(q, k, v, sl, True)
    out, lse = decode_attention(q.to(device), kp.to(device), vp.to(device), seq_lens=sl.to(device),
                                block_table=table.to(device), causal=True, impl="triton",
                                config=DecodeConfig(block_n=16, num_splits=3))
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device=device), what="mqa sq5 paged bf16")


def test_causal_token_i_is_single_token_decode_of_its_prefix():
    """The meaning of causal, checked against the one-token API: token i of Sq equals a
    [B, Hq, D] decode over the first seq_len - Sq + 1 + i keys (0 keys: out 0, lse -inf)."""
    sq = 4
    q, k, v = _inputs(2, sq, 4, 2, 16, 12, seed=5)
    sl = torch.tensor([12, 2])
    out, lse = decode_attention(q, k, v, seq_lens=sl, causal=True, impl="torch")
    for i in range(sq):
        lim = (sl - sq + 1 + i).clamp(min=0)
        o_i, l_i = decode_attention_float64(q[:, i], k, v, seq_lens=lim)
        assert_decode_close(out[:, i], lse[:, i], o_i, l_i, tol_for(torch.float32), what=f"token {i}")


def test_gather_pages_roundtrip_and_unread_pages_are_zero():
    _, k, v = _inputs(3, 1, 2, 2, 8, 20, seed=1)
    lens = [20, 7, 0]
    k, v, kp, _vp, table = to_paged(k, v, lens, 6, seed=1, share=True)
    got = gather_pages(kp, table, torch.tensor(lens))
    assert got.shape == (3, table.shape[1] * 6, 2, 8)
    for row, n in enumerate(lens):
        assert torch.equal(got[row, :n], k[row, :n])
        pages = -(-n // 6)
        assert torch.all(got[row, pages * 6 :] == 0)  # entries past the row's pages (-1) are not read
    # A pool with no pages yet (every row empty, its table all -1): zeros, no index into the pool.
    empty = gather_pages(kp[:0], torch.full((2, 3), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    assert empty.shape == (2, 18, 2, 8) and torch.all(empty == 0)


def test_decode_step_follows_block_table_and_lengths():
    """DecodeStep on static buffers: the block table's contents and the lengths change between
    steps (a page appended, pages reordered); each step equals float64 on its tokens."""
    q, k, v = _inputs(2, 3, 4, 2, 16, 24, seed=2)
    k, v, kp, vp, table = to_paged(k, v, [24, 24], 4, seed=2)
    sl = torch.tensor([10, 5], dtype=torch.int32)
    q_buf, table_buf = q.clone(), table.clone()
    step = DecodeStep(q_buf, kp, vp, sl, block_table=table_buf, causal=True)
    for s, lens in enumerate(([10, 5], [11, 9], [24, 3])):
        sl.copy_(torch.tensor(lens))
        q_buf.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(s)))
        if s == 2:  # same tokens, the table's order of rows swapped with the pool's pages
            k, v, table_buf = k.flip(0), v.flip(0), table_buf.copy_(table.flip(0))
            sl.copy_(torch.tensor(lens[::-1]))
        out, lse = step()
        ref_out, ref_lse = _truth(q_buf, k, v, sl, True)
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32), what=f"step {s}")


def test_prepared_cache_keys_on_causal_and_table_shape():
    """The same tensors with causal on and off, or a wider block table, are different
    signatures: the second call must not reuse the first one's prepared object."""
    q, k, v = _inputs(1, 4, 4, 1, 16, 16, seed=4)
    sl = torch.tensor([16])
    a = decode_attention(q, k, v, seq_lens=sl)
    c = decode_attention(q, k, v, seq_lens=sl, causal=True)
    assert not torch.allclose(a[0][:, 0], c[0][:, 0])  # token 0 sees 13 keys under causal, 16 without
    assert torch.allclose(a[0][:, -1], c[0][:, -1], atol=1e-6)  # the last token sees all either way
    k, v, kp, vp, table = to_paged(k, v, [16], 4, seed=4)
    narrow = decode_attention(q, kp, vp, seq_lens=sl, block_table=table)
    wide_table = torch.cat([table, torch.full((1, 3), -1, dtype=torch.int32)], 1)
    wide = decode_attention(q, kp, vp, seq_lens=sl, block_table=wide_table)
    assert_decode_close(wide[0], wide[1], narrow[0], narrow[1], tol_for(torch.float32), what="wider table")


# -- bad input: clear errors ---------------------------------------------------------------------


def _paged_call(**over):
    q, k, v = _inputs(2, 1, 4, 2, 16, 12, seed=6)
    k, v, kp, vp, table = to_paged(k, v, [12, 5], 4, seed=6)
    kw = dict(q=q[:, 0], k=kp, v=vp, seq_lens=torch.tensor([12, 5]), block_table=table, impl="torch")
    kw.update(over)
    return decode_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_block_table_pointing_outside_the_pool_names_row_block_value():
    table = to_paged(*_inputs(2, 1, 4, 2, 16, 12, seed=6)[1:], [12, 5], 4, seed=6)[4]
    num_blocks = 3 + 2 + 2  # pages of the two rows, plus spares
    bad = table.clone()
    bad[1, 1] = num_blocks  # row 1 (5 tokens) reads entries 0 and 1
    with pytest.raises(ShapeError,
                       match=rf"block_table\[1, 1\] = {num_blocks} points outside the pool of {num_blocks} blocks"):
        _paged_call(block_table=bad)
    bad = table.clone()
    bad[0, 2] = -3
    with pytest.raises(ShapeError, match=r"block_table\[0, 2\] = -3"):
        _paged_call(block_table=bad)
    ok = table.clone()
    ok[1, 2:] = 10**6  # past row 1's pages: never read, never checked
    _paged_call(block_table=ok)


@pytest.mark.parametrize("block_size", [0, 257, 512])
def test_block_sizes_the_kernels_cannot_take(block_size):
    kp = torch.zeros(4, block_size, 2, 16)
    with pytest.raises(ConfigError, match=rf"block size {block_size} .* outside 1\.\.256"):
        _paged_call(k=kp, v=kp, block_table=torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(seq_lens=None), "needs seq_lens"),
        (dict(block_table=torch.zeros(2, 4)), "block_table must be an int32 tensor"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)),
         r"block_table must be \[B, max_blocks\] = \[2, max_blocks\]"),
        (dict(block_table=[[0]]), "block_table must be an int32 torch.Tensor"),
        (dict(seq_lens=torch.tensor([12, 99])), r"seq_lens must lie in 0\.\.N=16"),
        (dict(q=torch.zeros(2, 17, 4, 16)), "1..16 query tokens per row; got Sq=17"),
    ],
    ids=["no-seq-lens", "float-table", "table-batch", "table-not-tensor", "len-past-capacity", "sq-17"],
)
def test_bad_paged_and_multi_token_inputs(over, match):
    with pytest.raises(ShapeError, match=match):
        _paged_call(**over)


def test_causal_must_be_a_bool():
    with pytest.raises(ConfigError, match="causal must be True or False"):
        _paged_call(causal="yes")


def test_check_block_table_reads_only_needed_entries():
    table = torch.tensor([[0, 5, -1], [2, -1, -1]], dtype=torch.int32)
    check_block_table(table, torch.tensor([5, 3]), num_blocks=6, block_size=3)
    with pytest.raises(ShapeError, match=r"block_table\[1, 1\] = -1"):
        check_block_table(table, torch.tensor([5, 4]), num_blocks=6, block_size=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpu_path_paged_chunks_and_blocks(dtype):
    """The CPU path gathers a paged pool chunk by chunk: chunks of 5 tokens over 3-token pages,
    softmax blocks of 10 tokens (rows merge several blocks), causal Sq=4 masking across a block
    edge, a row of length 0 and one shorter than Sq."""
    from tree_attn.kernels.cpu_decode import decode_attention_cpu

    q, k, v = _inputs(4, 4, 8, 2, 16, 33, dtype, seed=13)
    lens = [33, 0, 2, 21]
    k, v, kp, vp, table = to_paged(k, v, lens, 3, seed=13, share=True)
    sl = torch.tensor(lens)
    for causal in (False, True):
        out, lse = decode_attention_cpu(q, kp, vp, seq_lens=sl, block_table=table, causal=causal, chunk_tokens=5,
                                        block_tokens=10)
        ref_out, ref_lse = _truth(q, k, v, sl, causal)
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(dtype), what=f"cpu paged causal={causal}")


@pytest.mark.parametrize("splits", [1, 3])
def test_packed_message_layout_with_several_tokens(splits, device):
    """The layout a reduction sends ([B, Sq, Hq, D + 1] float32, out and lse as views of one
    buffer), written by the Triton kernel straight from stage one (1 split) or by stage two (3
    splits, which sees the Sq x Hq (token, head) pairs as heads), paged and causal."""
    from tree_attn.kernels.layout import PACKED
    from tree_attn.kernels.prepared import PreparedDecode

    q, k, v = _inputs(2, 3, 8, 2, 16, 40, seed=21)
    lens = [40, 11]
    k, v, kp, vp, table = to_paged(k, v, lens, 16, seed=21)
    sl = torch.tensor(lens, dtype=torch.int32)
    args = [t.to(device) for t in (q, kp, vp, sl)]
    prep = PreparedDecode(*args, impl="triton", config=DecodeConfig(block_n=16, num_splits=splits), out_layout=PACKED,
                          block_table=table.to(device), causal=True)
    out, lse = prep.new_outputs()
    assert out.shape == (2, 3, 8, 16) and out.stride() == (3 * 8 * 17, 8 * 17, 17, 1)
    prep(*args, out, lse, table.to(device))
    ref_out, ref_lse = _truth(q, k, v, sl, True)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device),
                        what=f"packed, {splits} splits")


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), d=st.sampled_from([8, 16, 24]),
    n=st.integers(0, 40), block_size=st.sampled_from([1, 2, 3, 5, 8, 16, 33, 256]), sq=st.integers(1, 16),
    causal=st.booleans(), share=st.booleans(), data=st.data(),
)
def test_random_paged_multi_token_cpu(b, hkv, group, d, n, block_size, sq, causal, share, data):
    """The CPU path on random shapes, block sizes, Sq and lengths (small chunks and blocks, so rows
    span several of each), paged against float64."""
    from tree_attn.kernels.cpu_decode import decode_attention_cpu

    lens = data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    q, k, v = _inputs(b, sq, hkv * group, hkv, d, n, seed=n * 31 + sq)
    k, v, kp, vp, table = to_paged(k, v, lens, block_size, seed=n, share=share)
    sl = torch.tensor(lens)
    chunk = data.draw(st.sampled_from([None, 1, 4, 7]))
    out, lse = decode_attention_cpu(q, kp, vp, seq_lens=sl, block_table=table, causal=causal, chunk_tokens=chunk,
                                    block_tokens=None if chunk is None else 2 * chunk)
    ref_out, ref_lse = _truth(q, k, v, sl, causal)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32),
                        what=f"b{b} n{n} bs{block_size} sq{sq} causal={causal}")
