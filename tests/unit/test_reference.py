"""The torch reference (the specification and CPU fast path) against a float64 computation."""

import pytest
import torch

from tests.tolerances import assert_state_close, random_decode_inputs
from tree_attn import ConfigError, KernelUnavailableError, ShapeError, decode_attention
from tree_attn.kernels.reference import decode_attention_float64, decode_attention_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("chunk", [None, 7])  # one chunk; many chunks, the last one partial
def test_matches_float64(dtype, hq, hkv, chunk):
    q, k, v = random_decode_inputs(3, hq, hkv, 80, 45, dtype=dtype, seed=hq + hkv)
    seq_lens = torch.tensor([45, 0, 17])
    out, lse = decode_attention_torch(q, k, v, seq_lens=seq_lens, chunk_tokens=chunk)
    assert out.dtype == dtype and out.shape == (3, hq, 80) and lse.shape == (3, hq)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=seq_lens)
    assert_state_close(out, lse, ref_out, ref_lse, dtype)


def test_empty_cache_gives_zero_and_minus_inf():
    q, k, v = random_decode_inputs(2, 4, 2, 16, 0)
    out, lse = decode_attention(q, k, v, impl="torch")
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_large_logits_do_not_overflow():
    q, k, v = random_decode_inputs(2, 8, 2, 64, 300, seed=5, q_scale=30.0)
    out, lse = decode_attention_torch(q, k, v, chunk_tokens=64)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert ref_lse.abs().max() > 50  # the scores really are large
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32, large_logits=True)


def test_custom_scale():
    q, k, v = random_decode_inputs(1, 4, 1, 32, 20, seed=9)
    out, lse = decode_attention(q, k, v, scale=0.05, impl="torch")
    ref_out, ref_lse = decode_attention_float64(q, k, v, scale=0.05)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_chunking_keeps_memory_bounded_shape_independent():
    # The chunk size adapts to B * Hkv * D so one float32 chunk is at most ~16 MiB.
    from tree_attn.kernels.reference import CHUNK_ELEMENTS
    from tree_attn.kernels.reference import chunk_tokens_for as _chunk_tokens

    assert _chunk_tokens(1, 8, 128) * 8 * 128 <= CHUNK_ELEMENTS
    assert _chunk_tokens(16, 8, 128) * 16 * 8 * 128 <= CHUNK_ELEMENTS


@pytest.mark.parametrize(
    "q_shape,k_shape,seq_lens,match",
    [
        ((2, 8, 16), (2, 5, 3, 16), None, "multiple of KV heads"),
        ((2, 8, 16), (3, 5, 2, 16), None, "batch mismatch"),
        ((2, 8, 16), (2, 5, 2, 32), None, "head dim mismatch"),
        ((2, 8), (2, 5, 2, 16), None, r"q must be \[B, Hq, D\]"),
        ((2, 8, 16), (2, 5, 2, 16), torch.tensor([1, 6]), "seq_lens must lie in 0..N=5"),
        ((2, 8, 16), (2, 5, 2, 16), torch.tensor([1.0, 2.0]), "integer"),
        ((2, 8, 16), (2, 5, 2, 16), torch.tensor([1]), r"seq_lens must be \[B\]"),
    ],
)
def test_bad_inputs_raise_clear_errors(q_shape, k_shape, seq_lens, match):
    q = torch.randn(q_shape)
    k = torch.randn(k_shape)
    with pytest.raises(ShapeError, match=match):
        decode_attention(q, k, k, seq_lens=seq_lens, impl="torch")


def test_impl_selection(monkeypatch):
    q, k, v = random_decode_inputs(1, 2, 1, 8, 3)
    with pytest.raises(ConfigError, match="impl must be one of"):
        decode_attention(q, k, v, impl="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        decode_attention(q, k, v, impl="triton")
