"""The Triton split-KV kernel against the torch reference and float64, on small awkward shapes.

Runs on the GPU if there is one, else in Triton's CPU interpreter (see conftest.py); the shapes are
kept tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tests.decode_shapes import decode_cases
from tests.tolerances import assert_decode_close, tol_for
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.dispatch import decode_attention
from tree_attn.kernels.reference import decode_attention_float64, decode_attention_torch
from tree_attn.kernels.triton_launch import decode_attention_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(b, hq, hkv, d, n, dtype, device, *, seed=0, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * q_scale).to(dtype).to(device)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


def check_against_references(q, k, v, seq_lens=None, config=None, what=""):
    out, lse = decode_attention_triton(q, k, v, seq_lens=seq_lens, config=config)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    tol = tol_for(q.dtype, k.dtype, device=q.device)
    o64, l64 = decode_attention_float64(q, k, v, seq_lens=seq_lens)
    assert_decode_close(out, lse, o64, l64, tol, what=f"{what} vs float64")
    ot, lt = decode_attention_torch(q, k, v, seq_lens=seq_lens)
    assert_decode_close(out, lse, ot, lt, tol, what=f"{what} vs torch reference")
    return out, lse


# (B, Hq, Hkv, D, N, seq_lens or None, config or None): each line names what it exercises.
CASES = {
    "gqa4_d64_n_not_multiple_of_block": (2, 8, 2, 64, 100, None, DecodeConfig(block_n=32, num_splits=3)),
    "gqa1_d80_single_split_direct_write": (1, 2, 2, 80, 37, None, DecodeConfig(block_n=16, num_splits=1)),
    "gqa8_d128_fewer_keys_than_splits": (1, 8, 1, 128, 5, None, DecodeConfig(block_n=16, num_splits=4)),
    "one_key": (2, 4, 2, 64, 1, None, DecodeConfig(block_n=16, num_splits=2)),
    "seq_lens_with_zeros": (3, 4, 1, 64, 50, [50, 0, 17], DecodeConfig(block_n=16, num_splits=3)),
    "all_rows_empty": (2, 4, 2, 64, 20, [0, 0], DecodeConfig(block_n=16, num_splits=2)),
    "default_config_d96": (2, 4, 1, 96, 70, [70, 33], None),
    "heuristic_splits_bn64": (2, 8, 2, 128, 200, None, DecodeConfig(block_n=64, num_splits=None)),
    "bn16_many_splits_stage2_loops": (1, 4, 1, 64, 300, None, DecodeConfig(block_n=16, num_splits=19)),
    "mqa_group80_two_group_blocks": (1, 80, 1, 16, 20, None, DecodeConfig(block_n=16, num_splits=2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_references(case, dtype, device):
    b, hq, hkv, d, n, lens, config = CASES[case]
    q, k, v = make_inputs(b, hq, hkv, d, n, dtype, device, seed=list(CASES).index(case))
    seq_lens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
    check_against_references(q, k, v, seq_lens, config, what=f"{case}/{dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).replace("torch.", ""))
def test_zero_length_cache(dtype, device):
    q, k, v = make_inputs(2, 4, 2, 64, 0, dtype, device)
    out, lse = decode_attention(q, k, v, impl="triton", config=DecodeConfig(block_n=16, num_splits=2))
    assert out.dtype == dtype and torch.all(out == 0)
    assert lse.dtype == torch.float32 and torch.all(lse == float("-inf"))


def test_empty_batch(device):
    q, k, v = make_inputs(0, 4, 2, 64, 10, torch.float32, device)
    out, lse = decode_attention_triton(q, k, v)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_count_does_not_change_result(splits, device):
    """Different splittings of the same keys merge to the same state (fp32: tight)."""
    q, k, v = make_inputs(2, 4, 1, 64, 90, torch.float32, device, seed=3)
    out, lse = decode_attention_triton(q, k, v, config=DecodeConfig(block_n=16, num_splits=splits))
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device), what=f"splits={splits}")


def test_noncontiguous_strides(device):
    """k/v slices of a bigger cache, a head-major cache permuted to [B, N, Hkv, D], a strided q,
    and a last-dim stride of 2 (STRIDE_KD != 1)."""
    b, hq, hkv, d, n = 2, 8, 2, 64, 45
    g = torch.Generator().manual_seed(11)
    q_big = torch.randn(b, hq, 2 * d, generator=g).to(device)
    q = q_big[:, :, d:]  # stride_qh = 2D
    k_cache = torch.randn(b, 64, hkv, d, generator=g).to(device)
    k = k_cache[:, 3 : 3 + n]  # slice along N: offset base, stride_kb = 64*Hkv*D
    v_head_major = torch.randn(b, hkv, n, d, generator=g).to(device)
    v = v_head_major.permute(0, 2, 1, 3)  # stride_vn = D, stride_vh = N*D
    assert not k.is_contiguous() and not v.is_contiguous() and not q.is_contiguous()
    check_against_references(q, k, v, config=DecodeConfig(block_n=16, num_splits=3), what="strided")
    k2_store = torch.randn(b, n, hkv, 2 * d, generator=g).to(device)
    k2 = k2_store[..., ::2]  # last-dim stride 2
    check_against_references(q, k2, v, config=DecodeConfig(block_n=32, num_splits=2), what="d-stride 2")


# (q dtype, cache dtype): a 16-bit cache takes a query of another dtype in parts of its own dtype
# (fp16 / fp32 over bf16: 2 / 3 parts; bf16 / fp32 over fp16: 1 / 3, prescaled); an fp32 cache
# computes in fp32 (see kernels.config.dot_math).
MIXED = [
    (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
    (torch.float32, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("q_dtype,kv_dtype", MIXED, ids=[f"q_{str(a)[6:]}-kv_{str(b)[6:]}" for a, b in MIXED])
def test_mixed_dtypes_keep_the_query_precise(q_dtype, kv_dtype, device):
    """A query in one dtype over a cache in another, against float64 with the tolerance of the
    query's dtype, not the coarser cache's: the query (and the softmax weights) must not be
    rounded to the cache's dtype. Scores of ~10 make such a rounding visible: the last assert
    shows that q rounded to bf16 would miss that tolerance."""
    b, hq, hkv, d, n = 2, 8, 2, 64, 45
    q, _, _ = make_inputs(b, hq, hkv, d, n, q_dtype, device, seed=5, q_scale=4.0)
    _, k, v = make_inputs(b, hq, hkv, d, n, kv_dtype, device, seed=6)
    lens = torch.tensor([45, 29], dtype=torch.int32, device=device)
    tol = tol_for(q_dtype, device=device)
    for config in (DecodeConfig(block_n=16, num_splits=3), DecodeConfig(block_n=32, num_splits=1)):
        out, lse = decode_attention_triton(q, k, v, seq_lens=lens, config=config)
        assert out.dtype == q_dtype
        o64, l64 = decode_attention_float64(q, k, v, seq_lens=lens)
        assert_decode_close(out, lse, o64, l64, tol, what=f"q {q_dtype} over {kv_dtype}, {config.describe()}")
    rounded = q.to(torch.bfloat16).to(q_dtype)
    if not torch.equal(rounded, q):
        r_out, r_lse = decode_attention_float64(rounded, k, v, seq_lens=lens)
        with pytest.raises(AssertionError):
            assert_decode_close(r_out.to(q_dtype), r_lse, o64, l64, tol, what="q rounded to bf16")


@pytest.mark.parametrize("q_scale,kv_scale,scale", [(3e5, 1e-5, 0.5), (1e-5, 1e4, 10.0)],
                         ids=["q_past_fp16_max", "q_below_fp16_normals"])
def test_bf16_query_outside_fp16_range_over_fp16_cache(q_scale, kv_scale, scale, device):
    """A bf16 query over an fp16 cache: q's values past fp16's largest (65504, they would become
    inf) or below its normals (2^-14, they would lose bits) are scaled into its range by a power of
    two first, so the scores (about 10 here) are those of the exact values. The last assert shows
    that q converted to fp16 as it is would miss the tolerance."""
    b, hq, hkv, d, n = 1, 4, 1, 64, 40
    g = torch.Generator().manual_seed(31)
    q = (torch.randn(b, hq, d, generator=g) * q_scale).to(torch.bfloat16).to(device)
    k = (torch.randn(b, n, hkv, d, generator=g) * kv_scale).clamp(-6e4, 6e4).to(torch.float16).to(device)
    v = torch.randn(b, n, hkv, d, generator=g).to(torch.float16).to(device)
    out, lse = decode_attention_triton(q, k, v, scale=scale, config=DecodeConfig(block_n=16, num_splits=2))
    o64, l64 = decode_attention_float64(q, k, v, scale=scale)
    tol = tol_for(torch.bfloat16, device=device)
    assert_decode_close(out, lse, o64, l64, tol, what=f"q x{q_scale:g} over fp16")
    as_fp16 = q.to(torch.float16).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        r_out, r_lse = decode_attention_float64(as_fp16, k, v, scale=scale)
        assert_decode_close(r_out.to(torch.bfloat16), r_lse, o64, l64, tol, what="q converted to fp16 unscaled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_peaked_scores_no_overflow(dtype, device):
    """Scores of magnitude ~100 (a near one-hot softmax): the online max shift must keep exp finite."""
    q, k, v = make_inputs(1, 4, 2, 64, 80, dtype, device, seed=8, q_scale=12.0)
    _out, lse = check_against_references(q, k, v, config=DecodeConfig(block_n=16, num_splits=3), what="peaked")
    assert torch.isfinite(lse).all()


def test_garbage_past_seq_len_is_never_read(device):
    """Positions past a row's length may hold NaN/inf (unwritten cache): they must not leak."""
    b, hq, hkv, d, n = 2, 4, 1, 64, 40
    q, k, v = make_inputs(b, hq, hkv, d, n, torch.float32, device, seed=9)
    lens = torch.tensor([25, 0], dtype=torch.int32, device=device)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, 25:] = float("nan")
    v_bad[0, 25:] = float("inf")
    k_bad[1] = float("nan")
    v_bad[1] = float("nan")
    out, lse = decode_attention_triton(q, k_bad, v_bad, seq_lens=lens, config=DecodeConfig(block_n=16, num_splits=2))
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device), what="garbage past seq_len")


def test_seq_lens_any_int_dtype_and_custom_scale(device):
    q, k, v = make_inputs(2, 4, 2, 64, 30, torch.float32, device, seed=12)
    lens = torch.tensor([30, 7], dtype=torch.int64, device=device)
    out, lse = decode_attention_triton(q, k, v, seq_lens=lens, scale=0.3, config=DecodeConfig(block_n=16, num_splits=2))
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens, scale=0.3)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device),
                        what="int64 seq_lens, scale 0.3")


def test_amd_option_rejected_off_rocm(monkeypatch, device):
    """waves_per_eu is an AMD option: asking for it on other hardware is a config error, not ignored.

    On a GPU the compiled kernel's device; without one, CPU tensors outside the interpreter (which
    accepts every option): the check comes before any launch either way."""
    from tree_attn.errors import ConfigError

    if device.type == "cuda" and torch.version.hip is not None:
        pytest.skip("on ROCm waves_per_eu is valid")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_inputs(1, 4, 1, 64, 8, torch.float32, device)
    with pytest.raises(ConfigError, match="waves_per_eu"):
        decode_attention_triton(q, k, v, config=DecodeConfig(block_n=16, num_splits=1, waves_per_eu=2))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=decode_cases(groups=[1, 2, 4, 8], head_dims=[16, 48, 64], max_splits=6), dtype=st.sampled_from(DTYPES))
def test_random_shapes(c, dtype, device):
    q, k, v = make_inputs(c.b, c.hkv * c.group, c.hkv, c.d, c.n, dtype, device, seed=c.n * 7 + c.d)
    seq_lens = torch.tensor(c.lens, dtype=torch.int32, device=device)
    check_against_references(
        q, k, v, seq_lens, DecodeConfig(block_n=c.block_n, num_splits=c.splits), what=f"random {c}"
    )


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter: NaN * 0 inside where
def test_stage_two_is_the_merge_algebra(device):
    """Stage two alone against tree_attn.reduce.state.merge_partials, with empty states (-inf), faulty ones
    (+inf, NaN) carrying garbage outputs, an all-empty row, and more splits than one loop tile."""
    from tree_attn.kernels.triton_launch import merge_splits_triton
    from tree_attn.reduce.state import merge_partials

    g = torch.Generator().manual_seed(21)
    b, h, s, d = 2, 3, 37, 80
    o_part = torch.randn(b, h, s, d, generator=g)
    lse_part = torch.randn(b, h, s, generator=g) * 5
    lse_part[0, 0, ::3] = float("-inf")
    lse_part[0, 1, 4] = float("inf")
    lse_part[0, 1, 5] = float("nan")
    o_part[0, 0, ::3] = float("nan")  # garbage in empty states must be ignored
    o_part[0, 1, 4:6] = float("inf")
    lse_part[1, 2, :] = float("-inf")  # all empty
    out, lse = merge_splits_triton(o_part.to(device), lse_part.to(device))
    ref_out, ref_lse = merge_partials(o_part.permute(2, 0, 1, 3), lse_part.permute(2, 0, 1))
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device), what="stage two")
    assert torch.all(out.cpu()[1, 2] == 0) and lse.cpu()[1, 2] == float("-inf")


@pytest.mark.parametrize("children,d", [(1, 128), (3, 80)])
def test_stage_two_on_the_tree_merges_views(children, d, device):
    """The tree merge's own call: stage two reading the stacked packed messages [S, B, H, D + 1] in
    place (strides of D + 1, lse at an offset of D) and writing the packed result, against the
    merge algebra. With one child the kernel merges two states; an empty state (-inf) included."""
    from tree_attn.kernels.triton_launch import merge_splits_triton
    from tree_attn.reduce.exchange import tree_merge_views
    from tree_attn.reduce.state import merge_states

    g = torch.Generator().manual_seed(23 + children)
    b, h = 2, 4
    states = torch.randn(1 + children, b, h, d + 1, generator=g)
    states[..., d] *= 4
    states[0, 1, 2, d] = float("-inf")
    states = states.to(device)
    merged = torch.full((b, h, d + 1), float("nan"), device=device)
    o_part, lse_part, out, lse = tree_merge_views(states, merged, d)
    assert not o_part.is_contiguous() and out.stride(1) == d + 1
    merge_splits_triton(o_part, lse_part, faulty_is_empty=False, out=out, lse=lse)
    ref_out, ref_lse = merge_states(states[..., :d].cpu(), states[..., d].cpu())
    assert_decode_close(merged[..., :d], merged[..., d], ref_out, ref_lse, tol_for(torch.float32, device=device),
                        what=f"tree merge of {1 + children} states")


def test_huge_sequence_stride_is_rejected_not_misread(device):
    """A cache whose keys are 2^27 elements apart: 32-key tiles would need offsets past int32."""
    from tree_attn.errors import ConfigError

    d = 16
    base = torch.empty(2**27 + 64, dtype=torch.float32, device=device)
    k = base.as_strided((1, 2, 1, d), (0, 2**27, d, 1))
    q = torch.randn(1, 1, d, device=device)
    with pytest.raises(ConfigError, match=r"sequence stride \(134,217,728 elements\) is too large for 32-key tiles"):
        decode_attention_triton(q, k, k, config=DecodeConfig(block_n=32, num_splits=1))
