"""The CPU decode path (tree_attn.kernels.cpu_decode) against the float64 truth: out and lse.

Awkward shapes on purpose: N not a multiple of the chunk or the softmax block, rows of length 0 and
partial rows, GQA ratios 1/4/8, D = 80, B > 1, N = 0, caches that are slices or transposes of
bigger tensors, and softmax blocks small enough that one row merges several block states.

Every test runs twice: as callers get it (the fused C kernel of ``cpu_native`` for the calls it
takes, when it is built here) and with the C kernel turned off (the torch ops for every call).
``test_cpu_native.py`` checks the C kernel on its own.
"""

import pytest
import torch

from tests.tolerances import assert_state_close, random_decode_inputs
from tree_attn import decode_attention
from tree_attn.kernels import cpu_decode
from tree_attn.kernels.cpu_decode import CHUNK_BYTES, SCORE_ELEMENTS, cpu_chunk_tokens, decode_attention_cpu
from tree_attn.kernels.reference import decode_attention_chunked, decode_attention_float64, decode_attention_torch


@pytest.fixture(autouse=True, params=["default", "torch-only"])
def kernel_path(request, monkeypatch):
    """"default": the C kernel where it applies; "torch-only": the torch path for every call."""
    if request.param == "torch-only":
        monkeypatch.setattr(cpu_decode, "_native_kernel_for", lambda *args, **kwargs: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize(
    "chunk,block",
    [
        (None, None),  # one chunk, one block
        (7, None),  # 45 = 6 x 7 + 3: whole chunks and a short last one
        (7, 14),  # blocks of 2 chunks: 4 block states merged per full row
        (5, 7),  # block rounded down to whole chunks (5); 45 = 9 x 5, no short chunk
        (1, 3),  # chunks of one token
    ],
)
def test_matches_float64(dtype, hq, hkv, chunk, block):
    q, k, v = random_decode_inputs(3, hq, hkv, 80, 45, dtype=dtype, seed=hq + hkv)
    seq_lens = torch.tensor([45, 0, 17])  # full, empty, partial (17 = 2 x 7 + 3)
    out, lse = decode_attention_cpu(q, k, v, seq_lens=seq_lens, chunk_tokens=chunk, block_tokens=block)
    assert out.dtype == dtype and out.shape == (3, hq, 80) and lse.shape == (3, hq)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=seq_lens)
    assert_state_close(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_chunking_at_a_real_shape(dtype):
    # Llama-3.1-8B heads (32/8, D 128): 256-token chunks, so 600 = 2 x 256 + 88; no seq_lens.
    q, k, v = random_decode_inputs(2, 32, 8, 128, 600, dtype=dtype, seed=3)
    assert cpu_chunk_tokens(8, 128) == 256
    out, lse = decode_attention_cpu(q, k, v)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_state_close(out, lse, ref_out, ref_lse, dtype)


def test_mqa_and_mixed_dtypes():
    # One KV head (no sequential touch needed), fp32 queries over a bf16 cache: out in q's dtype.
    q, k, v = random_decode_inputs(2, 8, 1, 64, 70, seed=4)
    k, v = k.bfloat16(), v.bfloat16()
    out, lse = decode_attention_cpu(q, k, v, seq_lens=torch.tensor([70, 33]), chunk_tokens=16)
    assert out.dtype == torch.float32
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=torch.tensor([70, 33]))
    assert_state_close(out, lse, ref_out, ref_lse, torch.bfloat16)


def _strided_caches(k: torch.Tensor, v: torch.Tensor):
    """(name, k, v) views of bigger tensors with the values of ``k, v [B, N, Hkv, D]``."""
    b, n, hkv, d = k.shape
    big_k = torch.randn(b, n + 9, hkv, d).to(k.dtype)
    big_v = torch.randn(b, n + 9, hkv, d).to(v.dtype)
    big_k[:, 4 : 4 + n] = k
    big_v[:, 4 : 4 + n] = v
    yield "slice of a longer cache", big_k[:, 4 : 4 + n], big_v[:, 4 : 4 + n]
    kv = torch.stack([k, v], dim=2)  # [B, N, 2, Hkv, D]: K and V interleaved per token
    yield "interleaved K/V", kv[:, :, 0], kv[:, :, 1]
    wide_k = torch.zeros(b, n, hkv, d + 16).to(k.dtype)
    wide_v = torch.zeros(b, n, hkv, d + 16).to(v.dtype)
    wide_k[..., :d] = k
    wide_v[..., :d] = v
    yield "padded head dim", wide_k[..., :d], wide_v[..., :d]
    # A head-major cache [B, Hkv, N, D] seen as [B, N, Hkv, D]: a head's keys are contiguous.
    head_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
    yield "head-major transpose", head_major[0], head_major[1]
    rows_k = torch.randn(2 * b, n, hkv, d).to(k.dtype)
    rows_v = torch.randn(2 * b, n, hkv, d).to(v.dtype)
    rows_k[::2] = k
    rows_v[::2] = v
    yield "every other row of a batch", rows_k[::2], rows_v[::2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_caches(dtype):
    q, k, v = random_decode_inputs(2, 8, 2, 48, 37, dtype=dtype, seed=11)
    seq_lens = torch.tensor([37, 20])
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=seq_lens)
    for name, ks, vs in _strided_caches(k, v):
        assert not ks.is_contiguous(), name
        for chunk, block in ((None, None), (8, 16)):
            out, lse = decode_attention_cpu(q, ks, vs, seq_lens=seq_lens, chunk_tokens=chunk, block_tokens=block)
            assert_state_close(out, lse, ref_out, ref_lse, dtype)
        assert torch.equal(ks, k) and torch.equal(vs, v), f"{name}: the cache must not be modified"


def test_empty_cache_and_empty_rows():
    q, k, v = random_decode_inputs(2, 4, 2, 16, 0)
    out, lse = decode_attention_cpu(q, k, v)
    assert out.shape == (2, 4, 16) and (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = random_decode_inputs(3, 4, 2, 16, 10)
    out, lse = decode_attention_cpu(q, k, v, seq_lens=torch.zeros(3, dtype=torch.int64))
    assert (out == 0).all() and torch.isneginf(lse).all() and not out.isnan().any()


def test_large_logits_across_blocks():
    q, k, v = random_decode_inputs(2, 8, 2, 64, 300, seed=5, q_scale=30.0)
    out, lse = decode_attention_cpu(q, k, v, chunk_tokens=32, block_tokens=64)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert ref_lse.abs().max() > 50  # the scores really are large
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32, large_logits=True)


def test_custom_scale():
    q, k, v = random_decode_inputs(1, 4, 1, 32, 20, seed=9)
    out, lse = decode_attention_cpu(q, k, v, scale=0.05, chunk_tokens=6)
    ref_out, ref_lse = decode_attention_float64(q, k, v, scale=0.05)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_nan_stays_in_its_row():
    q, k, v = random_decode_inputs(2, 4, 2, 16, 30, seed=2)
    k[0, 12, 1, 3] = float("nan")
    out, lse = decode_attention_cpu(q, k, v, chunk_tokens=8)
    assert out[0].isnan().any()
    ref_out, ref_lse = decode_attention_float64(q[1:], k[1:], v[1:])
    assert_state_close(out[1:], lse[1:], ref_out, ref_lse, torch.float32)


def test_public_paths_run_the_cpu_path():
    # decode_attention(impl="torch" / "auto") and decode_attention_torch reach decode_attention_cpu
    # on CPU tensors: same bits.
    q, k, v = random_decode_inputs(2, 8, 2, 64, 500, seed=6)
    lens = torch.tensor([500, 311])
    expect = decode_attention_cpu(q, k, v, seq_lens=lens)
    for out, lse in (
        decode_attention_torch(q, k, v, seq_lens=lens),
        decode_attention(q, k, v, seq_lens=lens, impl="torch"),
        decode_attention(q, k, v, seq_lens=lens, impl="auto"),
    ):
        assert torch.equal(out, expect[0]) and torch.equal(lse, expect[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_form_matches_float64(dtype):
    # The device-agnostic form (what non-CPU tensors run under impl="torch"), checked on CPU.
    q, k, v = random_decode_inputs(3, 16, 2, 80, 45, dtype=dtype, seed=8)
    seq_lens = torch.tensor([45, 0, 17])
    out, lse = decode_attention_chunked(q, k, v, seq_lens=seq_lens, chunk_tokens=7)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=seq_lens)
    assert_state_close(out, lse, ref_out, ref_lse, dtype)


def test_extra_memory_is_bounded():
    # One float32 chunk is ~CHUNK_BYTES whatever the shape, and the score block SCORE_ELEMENTS
    # floats: neither grows with N.
    for hkv, d in ((8, 128), (1, 64), (32, 256), (64, 512)):
        c = cpu_chunk_tokens(hkv, d)
        assert c >= 16 and (c * hkv * d * 4 <= CHUNK_BYTES or c == 16)
    assert SCORE_ELEMENTS * 4 <= 4 << 20


def test_inputs_that_need_gradients_take_the_differentiable_form():
    q, k, v = random_decode_inputs(1, 4, 2, 16, 40, seed=12)
    q.requires_grad_(True)
    out, lse = decode_attention_torch(q, k, v, chunk_tokens=8)
    (out.sum() + lse.sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    ref_out, ref_lse = decode_attention_float64(q.detach(), k, v)
    assert_state_close(out.detach(), lse.detach(), ref_out, ref_lse, torch.float32)


def test_non_contiguous_query():
    q, k, v = random_decode_inputs(3, 8, 2, 64, 50, seed=13)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hq, D] with batch as the inner stride
    assert not q.is_contiguous()
    out, lse = decode_attention_cpu(q, k, v, chunk_tokens=16)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)
