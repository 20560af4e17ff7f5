"""fp8 KV caches on CPU: the C kernel's widening of every fp8 code, the quantize helper, and
``decode_attention`` (C kernel, torch ops, chunked torch form) against float64 on the DEQUANTIZED
cache (the stored values times their head's scale, exactly), out and lse, at the bf16 tolerance.
Then the scales' checks (missing, unexpected, wrong shape/dtype/device, NaN, zero, negative).

The truth comes from ``tests/fp8_inputs.py`` and ``tests/paged_inputs.py``, written apart from the
library's quantize helper and reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fp8_inputs import FP8_MAX, dequantize, quantize
from tests.paged_inputs import float64_over_shards, to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn import quantize_kv
from tree_attn.errors import ConfigError
from tree_attn.kernels import cpu_native
from tree_attn.kernels.cpu_decode import decode_attention_cpu
from tree_attn.kernels.dispatch import decode_attention
from tree_attn.kernels.prepared import DecodeStep
from tree_attn.kernels.reference import decode_attention_chunked, decode_attention_float64

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
STATUS = cpu_native.native_status()
needs_kernel = pytest.mark.skipif(not STATUS.available, reason=f"the C kernel is not built here: {STATUS.detail}")
TOL = tol_for(torch.bfloat16)  # the bound for fp8 against the dequantized truth


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@needs_kernel
@pytest.mark.parametrize("fmt", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_c_widening_is_exact_for_every_code(fmt):
    """All 256 codes (zeros of both signs, subnormals, normals, the largest values, NaN) widened by
    the C kernel's integer arithmetic equal torch's own conversion bit for bit (NaN: any NaN)."""
    kernel = cpu_native.native_kernel()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    ours, torchs = kernel.widen(codes), codes.float()
    nan = torch.isnan(torchs)
    assert torch.equal(torch.isnan(ours), nan)
    assert int(nan.sum()) == (2 if fmt == FN else 1)  # e4m3fn: 0x7f, 0xff; fnuz: 0x80
    same = _bits(ours) == _bits(torchs)
    bad = (~same & ~nan).nonzero().flatten().tolist()
    assert not bad, f"codes {[hex(c) for c in bad]}: {ours[bad].tolist()} vs {torchs[bad].tolist()}"
    # The subnormals and the largest finite value are among them: a check that the table is whole.
    assert float(torchs[1]) == (2.0**-9 if fmt == FN else 2.0**-10)
    assert float(torchs[~nan].abs().max()) == FP8_MAX[fmt]


@needs_kernel
@pytest.mark.parametrize("fmt", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_c_fast_fp8_path_is_exact_for_every_finite_code(fmt):
    """The decode loops' AVX2 + F16C widening (half-float bits and a power of two) on every code
    but the NaN ones, which the loops send to the exact path (test_nan_codes_... below). The 512-bit
    path's widening: test_c_wide_widening_is_exact_for_every_code."""
    fast = cpu_native.native_kernel().widen_fp8_fast
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    if fast(codes) is None:
        pytest.skip("this build of the C kernel has no AVX2 + F16C fp8 path")
    finite = codes[~torch.isnan(codes.float())]
    finite = torch.cat([finite, finite[: (-finite.numel()) % 16]])  # a multiple of 16
    assert torch.equal(_bits(fast(finite)), _bits(finite.float()))


@needs_kernel
@pytest.mark.parametrize("dtype", [FN, FNUZ, torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_c_wide_widening_is_exact_for_every_code(dtype):
    """The 512-bit path's widening (fp8: two byte tables and the sign; bf16, fp16: every 16-bit
    code) equals torch's conversion bit for bit, NaN codes as NaN, element order restored."""
    kernel = cpu_native.native_kernel()
    bits = 8 if dtype in (FN, FNUZ) else 16 if dtype != torch.float32 else 32
    if bits == 32:
        codes = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e30
        codes[7], codes[100] = float("inf"), float("nan")
    else:
        codes = torch.arange(2**bits, dtype=torch.int32).to(torch.uint8 if bits == 8 else torch.int16).view(dtype)
    ours = kernel.widen_wide(codes)
    if ours is None:
        pytest.skip("this build of the C kernel has no 512-bit path (needs AVX-512 F, BW and VBMI)")
    torchs = codes.float()
    nan = torch.isnan(torchs)
    assert torch.equal(torch.isnan(ours), nan) and int(nan.sum()) >= 1
    assert torch.equal(_bits(ours)[~nan], _bits(torchs)[~nan])


def _case(b, sq, hq, hkv, d, n, *, q_dtype=torch.bfloat16, fmt=FN, seed=0, per_head=True, gains=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(q_dtype)
    k = torch.randn(b, n, hkv, d, generator=g) * 2.0
    v = torch.randn(b, n, hkv, d, generator=g)
    if gains is not None:
        k = k * torch.tensor(gains[0])[:, None]
        v = v * torch.tensor(gains[1])[:, None]
    k8, ks = quantize(k, fmt, per_head=per_head)
    v8, vs = quantize(v, fmt, per_head=per_head)
    return q, k8, v8, ks, vs, dequantize(k8, ks), dequantize(v8, vs)


def _truth(q, k64, v64, lens, causal=False):
    return float64_over_shards(q.double(), [(k64, v64, lens)], causal)


# (B, Sq, Hq, Hkv, D, N, lens or None, causal[, q dtype: bf16 unless given])
CASES = {
    "mha_n_not_multiple_of_chunk": (2, 1, 4, 4, 64, 300, None, False),
    "gqa4_short_and_empty_rows": (3, 1, 8, 2, 128, 517, [517, 0, 19], False),
    "gqa8_d80_two_tokens_causal": (2, 2, 8, 1, 80, 70, [70, 33], True),
    "gqa2_sq4": (1, 4, 4, 2, 64, 40, [40], False),
    # fp32 queries, so out is not rounded to bf16: these seeds give |out| > 8, where bf16's rounding
    # alone (half an ulp: 0.03) is beyond the bf16 row's atol
    "gqa3_d128": (2, 1, 6, 2, 128, 300, [300, 2], False, torch.float32),
    "gqa3_three_tokens_causal": (2, 3, 6, 2, 64, 300, [300, 2], True, torch.float32),  # 9 rows: not 512-bit
    "gqa5_d128": (2, 1, 10, 2, 128, 280, [280, 129], False),
    "gqa2_d40_no_fast_path": (2, 1, 4, 2, 40, 77, [77, 5], False),  # D not a multiple of 16: load_fp8
}


@pytest.mark.parametrize("path", ["torch_ops", "chunked"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_cpu_paths_match_float64_on_dequantized_cache(case, path):
    _check_case(case, path)


@needs_kernel
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_c_kernel_matches_float64_on_dequantized_cache(case, c_kernel_path):
    _check_case(case, "native")


def _check_case(case, path):
    b, sq, hq, hkv, d, n, lens, causal, *q_dtype = CASES[case]
    q_dtype = q_dtype[0] if q_dtype else torch.bfloat16
    for fmt in (FN, FNUZ):
        q, k8, v8, ks, vs, k64, v64 = _case(b, sq, hq, hkv, d, n, fmt=fmt, seed=len(case), q_dtype=q_dtype,
                                             gains=([0.01, 1.0, 3.0, 0.5][:hkv], [5.0, 1.0, 0.02, 2.0][:hkv]))
        sl = torch.tensor(lens if lens is not None else [n] * b, dtype=torch.int32)
        kw = dict(seq_lens=None if lens is None else sl, causal=causal, k_scale=ks, v_scale=vs)
        if path == "chunked":
            out, lse = decode_attention_chunked(q, k8, v8, chunk_tokens=64, **kw)
        else:
            out, lse = decode_attention_cpu(q, k8, v8, native=path == "native", **kw)
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        o64, l64 = _truth(q, k64, v64, sl, causal)
        assert_decode_close(out, lse, o64, l64, TOL, what=f"{case} {path} {fmt}")


@pytest.mark.parametrize("block_size", [1, 16, 37])
def test_paged_fp8_matches_float64(block_size, c_kernel_path):
    """A paged fp8 pool (pages shuffled, NaN codes in every slot no row may read)."""
    q, k8, v8, ks, vs, k64, v64 = _case(3, 1, 8, 2, 64, 150, seed=block_size)
    lens = torch.tensor([150, 0, 77], dtype=torch.int32)
    _, _, kp, vp, table = to_paged(k8, v8, lens.tolist(), block_size, seed=block_size)
    assert kp.dtype == FN and torch.isnan(kp.float()).any()
    o64, l64 = _truth(q, k64, v64, lens)
    for native in ([True, False] if STATUS.available else [False]):
        out, lse = decode_attention_cpu(q, kp, vp, seq_lens=lens, block_table=table, native=native,
                                        k_scale=ks, v_scale=vs)
        assert_decode_close(out, lse, o64, l64, TOL, what=f"paged bs {block_size} native {native}")
    out, lse = decode_attention(q[:, 0], kp, vp, seq_lens=lens, block_table=table, k_scale=ks, v_scale=vs)
    assert_decode_close(out[:, None], lse[:, None], o64, l64, TOL, what="decode_attention paged")


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_fp8_keys_split_over_threads(monkeypatch, threads, c_kernel_path):
    """The C kernel's key ranges on several threads (merged in C) over an fp8 paged pool, GQA 4,
    rows ending inside the first range and empty: against float64 on the dequantized cache."""
    monkeypatch.setattr(cpu_native, "MIN_WORK_PER_THREAD", 1)  # every thread takes a range
    q, k8, v8, ks, vs, k64, v64 = _case(3, 1, 8, 2, 64, 400, seed=threads)
    lens = torch.tensor([400, 90, 0], dtype=torch.int32)
    _, _, kp, vp, table = to_paged(k8, v8, lens.tolist(), 16, seed=threads)
    o64, l64 = _truth(q, k64, v64, lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = decode_attention_cpu(q, kp, vp, seq_lens=lens, block_table=table, native=True, k_scale=ks,
                                        v_scale=vs)
    finally:
        torch.set_num_threads(before)
    assert_decode_close(out, lse, o64, l64, TOL, what=f"fp8 paged on {threads} threads")


@pytest.mark.parametrize("form", ["tensor_hkv", "tensor_scalar", "tensor_one", "python_float", "float64_tensor"])
def test_decode_attention_scale_forms(form):
    """decode_attention takes a scale per KV head, a 0-d tensor, a Python number or another float
    dtype (converted); one scalar scale for every head (quantized with per_head=False)."""
    per_head = form in ("tensor_hkv", "float64_tensor")
    gains = ([1, 4, 0.1, 1], [1, 1, 9, 0.3])
    q, k8, v8, ks, vs, k64, v64 = _case(2, 1, 8, 4, 64, 100, seed=3, per_head=per_head, gains=gains)
    if form == "tensor_scalar":
        ks, vs = ks[0].clone(), vs[0].clone()
    elif form == "tensor_one":  # shape [1], as a scalar
        ks, vs = ks[:1].clone(), vs[:1].clone()
    elif form == "python_float":
        ks, vs = float(ks[0]), float(vs[0])
    elif form == "float64_tensor":
        ks, vs = ks.double(), vs.double()
    out, lse = decode_attention(q[:, 0], k8, v8, k_scale=ks, v_scale=vs)
    o64, l64 = _truth(q, k64, v64, torch.full((2,), 100))
    assert_decode_close(out[:, None], lse[:, None], o64, l64, TOL, what=form)
    # The library's own float64 reference agrees with the independent truth.
    r64, rl64 = decode_attention_float64(q[:, 0], k8, v8, k_scale=ks, v_scale=vs)
    assert torch.allclose(r64, o64[:, 0], rtol=1e-10, atol=1e-12) and torch.allclose(rl64, l64[:, 0], rtol=1e-12)


def test_scales_are_read_per_head_and_per_call():
    """The same stored values with other scales give the other cache's result: nothing cached
    from the first call's values (a DecodeStep reads its scale tensors at every step)."""
    q, k8, v8, ks, vs, k64, v64 = _case(1, 1, 4, 4, 64, 90, seed=9, gains=([1, 2, 3, 4], [4, 3, 2, 1]))
    step = DecodeStep(q[:, 0], k8, v8, k_scale=ks, v_scale=vs)
    out, lse = step()
    o64, l64 = _truth(q, k64, v64, torch.tensor([90]))
    assert_decode_close(out[:, None], lse[:, None], o64, l64, TOL, what="step")
    ks.mul_(2.0)
    vs.mul_(0.5)
    out, lse = step()
    o64, l64 = _truth(q, dequantize(k8, ks), dequantize(v8, vs), torch.tensor([90]))
    assert_decode_close(out[:, None], lse[:, None], o64, l64, TOL, what="step after in-place update")


def test_quantize_kv_per_head_scales_and_zero_head():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 33, 3, 16, generator=g, dtype=torch.float32).bfloat16()
    v = torch.randn(2, 33, 3, 16, generator=g)
    k[:, :, 1] = 0  # an all-zero head: scale 1, stored exactly
    v[0, 5, 2, 7] = 1000.0
    k8, v8, ks, vs = quantize_kv(k, v)
    assert k8.dtype == v8.dtype == FN and k8.shape == k.shape and v8.shape == v.shape
    assert ks.dtype == vs.dtype == torch.float32 and ks.shape == vs.shape == (3,)
    amax_k = k.float().abs().amax(dim=(0, 1, 3))
    assert torch.equal(ks, torch.where(amax_k > 0, amax_k / 448, torch.ones(3)))
    assert float(ks[1]) == 1.0 and torch.all(k8[:, :, 1].float() == 0)
    assert float(vs[2]) == pytest.approx(1000.0 / 448)
    assert float(v8[0, 5, 2, 7].float()) == 448.0  # the head's maximum is stored as the format's
    # Round to nearest: every value within half an fp8 step (relative 2^-4) of the original.
    err = (dequantize(v8, vs) - v.double()).abs()
    assert bool((err <= v.double().abs() * 2.0**-4 + vs.double().max() * 2.0**-9).all())
    k8z, _, ksz, _ = quantize_kv(k, v, dtype=FNUZ)
    assert k8z.dtype == FNUZ and torch.allclose(ksz[0], amax_k[0] / 240)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_kv_and_the_store_leave_their_inputs_alone(dtype):
    """Quantizing reads its inputs only: a float32 cache (whose ``.float()`` is itself) once came
    back as its absolute values, and the fp8 store wrote |K| into its pools."""
    from tree_attn.commands.generate.kv_store import PagedKVShard
    from tree_attn.kernels.fp8 import head_amax

    g = torch.Generator().manual_seed(7)
    k = torch.randn(2, 21, 3, 8, generator=g).to(dtype)
    v = torch.randn(2, 21, 3, 8, generator=g).to(dtype)
    k0, v0 = k.clone(), v.clone()
    k8, v8, ks, vs = quantize_kv(k, v)
    head_amax(k)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    # What is stored is the cache, signs and all: within half an fp8 step of each value.
    for x, x8, s in ((k, k8, ks), (v, v8, vs)):
        err = (dequantize(x8, s) - x.double()).abs()
        assert bool((err <= x.double().abs() * 2.0**-4 + s.double().max() * 2.0**-9).all())
    store = PagedKVShard.allocate(1, 32, 3, 8, dtype=FN, device="cpu", page_size=8, seed=2)
    store.write(0, 0, k[0], v[0])
    store.set_length(21)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    kk, vv = store.read(0)
    assert torch.equal(dequantize(kk, store.k_scale[0]).sign(), k[0].double().sign())
    assert torch.equal(dequantize(vv, store.v_scale[0]).sign(), v[0].double().sign())


def test_quantize_kv_leaves_nan_and_inf_out_of_the_scales():
    """NaN and infinities in the cache become NaN codes; the scales come from the finite values."""
    g = torch.Generator().manual_seed(11)
    k = torch.randn(3, 5, 2, 8, generator=g)
    v = torch.randn(3, 5, 2, 8, generator=g)
    finite_amax = k.abs().amax(dim=(0, 1, 3))
    bad = [(0, 1, 0, 2, float("inf")), (1, 4, 1, 0, float("nan")), (2, 0, 0, 7, float("-inf"))]
    for b, t, h, d, x in bad:
        k[b, t, h, d] = x
    k8, _, ks, _ = quantize_kv(k, v)
    assert torch.equal(ks, finite_amax / 448)
    nan = torch.isnan(k8.float())
    assert [tuple(i) for i in nan.nonzero().tolist()] == [b[:4] for b in bad]


@pytest.mark.parametrize("fmt", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_quantize_saturates_at_the_formats_largest_value(fmt):
    """A value beyond what the scale can store (a new token larger than the prefill's maximum) is
    stored as +-max, never NaN, in both formats (e4m3fnuz's own conversion gives NaN there)."""
    from tree_attn.kernels.fp8 import quantize

    top = FP8_MAX[fmt]
    x = torch.tensor([1.0, -1.0, top + 20, -(top + 20), 1e4, -1e30]).reshape(1, 2, 3)
    stored = quantize(x, torch.tensor([1.0, 0.5]), fmt).float().reshape(-1)
    assert stored.tolist() == [1.0, -1.0, top, -top, top, -top]


def test_quantize_kv_in_chunks_equals_one_pass(monkeypatch):
    """Chunked conversion (bounded memory) changes nothing: chunks of 3 rows over 22 rows (the
    last chunk short), and of one row, give the same scales and bytes as one chunk; the head's
    maximum sits in the last row. The library's dequantize is the independent one, per head."""
    from tree_attn.kernels import fp8

    g = torch.Generator().manual_seed(12)
    k = torch.randn(2, 11, 3, 8, generator=g)
    v = torch.randn(2, 11, 3, 8, generator=g).bfloat16()
    k[1, 10, 2, 5] = 50.0
    whole = quantize_kv(k, v)
    for rows in (3, 1):
        monkeypatch.setattr(fp8, "QUANTIZE_CHUNK_ELEMENTS", rows * 3 * 8)
        chunked = quantize_kv(k, v)
        assert torch.equal(chunked[2], whole[2]) and torch.equal(chunked[3], whole[3])
        assert torch.equal(chunked[0].view(torch.uint8), whole[0].view(torch.uint8))
        assert torch.equal(chunked[1].view(torch.uint8), whole[1].view(torch.uint8))
    assert torch.equal(whole[2][2], torch.tensor(50.0) / 448)  # the last row counted
    k8, ks = whole[0], whole[2]
    assert len(set(ks.tolist())) == 3 and torch.equal(fp8.dequantize(k8, ks, torch.float64), dequantize(k8, ks))


def test_fp8_support_check_names_what_came_back():
    """The check that this torch converts an fp8 dtype on CPU compares values: a dtype that does
    not round-trip 1.5 and -0.25 is refused (int8 stands in for a build without fp8 conversions)."""
    from tree_attn.errors import KernelUnavailableError
    from tree_attn.kernels.fp8 import check_fp8_support

    check_fp8_support(FN)
    check_fp8_support(FNUZ)
    with pytest.raises(KernelUnavailableError, match=r"came back as \[1.0, 0.0\]"):
        check_fp8_support(torch.int8)


def test_quantize_kv_bad_inputs():
    k = torch.randn(1, 4, 2, 8)
    with pytest.raises(ConfigError, match="k and v must have the same KV heads"):
        quantize_kv(k, torch.randn(1, 4, 3, 8))
    with pytest.raises(ConfigError, match="float32/float16/bfloat16"):
        quantize_kv(k.to(FN), k)
    with pytest.raises(ConfigError, match="fp8 dtype"):
        quantize_kv(k, k, dtype=torch.bfloat16)


def _fp8_inputs():
    q, k8, v8, ks, vs, _, _ = _case(2, 1, 4, 2, 32, 20, seed=2)
    return q[:, 0], k8, v8, ks, vs


@pytest.mark.parametrize(
    "what, kwargs, message",
    [
        ("missing both", dict(k_scale=None, v_scale=None), "needs its dequantization scales: pass k_scale and v_scale"),
        ("missing v", dict(v_scale=None), "pass v_scale"),
        ("wrong shape", dict(k_scale=torch.ones(3)),
         r"scalar or one scale per KV head \[Hkv\] = \[2\]; got shape \(3,\)"),
        ("2-d", dict(v_scale=torch.ones(2, 1)), "got shape"),
        ("int dtype", dict(k_scale=torch.ones(2, dtype=torch.int32)), "must be a float32 tensor"),
        ("fp8 dtype", dict(k_scale=torch.ones(2).to(FN)), "must be a float32 tensor"),
        ("nan", dict(k_scale=torch.tensor([1.0, float("nan")])), "got a NaN value"),
        ("zero", dict(v_scale=torch.tensor([0.0, 1.0])), "got a zero value"),
        ("negative number", dict(v_scale=-1.0), "got a negative value"),
        ("inf number", dict(k_scale=float("inf")), "got an infinite value"),
        # Checked as the kernels read them, in float32 (a float64 1e39 gave NaN out, 1e-50 zero).
        ("float64 beyond float32", dict(k_scale=torch.tensor([1.0, 1e39], dtype=torch.float64)),
         r"got an infinite value \(1e\+39, which is inf in float32\)"),
        ("float64 below float32", dict(v_scale=torch.tensor(1e-50, dtype=torch.float64)),
         r"got a zero value \(1e-50, which is 0.0 in float32\)"),
        ("number beyond float32", dict(v_scale=1e39), r"1e\+39, which is inf in float32"),
        ("bool", dict(k_scale=True), "positive finite number or a float32 tensor"),
        ("numpy negative", dict(v_scale=np.float32(-0.5)), "got a negative value"),
        ("list", dict(k_scale=[1.0, 1.0]), "positive finite number or a float32 tensor"),
        ("other device", dict(k_scale=torch.ones(2, device="meta")), "must be on the cache's device cpu; got meta"),
    ],
)
def test_bad_scales(what, kwargs, message):
    q, k8, v8, ks, vs = _fp8_inputs()
    kw = {"k_scale": ks, "v_scale": vs, **kwargs}
    with pytest.raises(ConfigError, match=message):
        decode_attention(q, k8, v8, **kw)


def test_scales_without_fp8_cache_and_fp8_query():
    q, k8, v8, ks, vs = _fp8_inputs()
    with pytest.raises(ConfigError, match="this cache is torch.bfloat16: drop the scales"):
        decode_attention(q, k8.bfloat16(), v8.bfloat16(), k_scale=ks, v_scale=vs)
    with pytest.raises(ConfigError, match="drop the scales"):
        decode_attention(q, k8.float(), v8.float(), v_scale=vs)
    with pytest.raises(ConfigError, match="this cache is torch.float8_e5m2: quantize"):
        decode_attention(q, k8.float().to(torch.float8_e5m2), v8.float().to(torch.float8_e5m2), k_scale=ks,
                         v_scale=vs)
    with pytest.raises(Exception, match="float16, bfloat16 or float32"):
        decode_attention(q.to(FN), k8, v8, k_scale=ks, v_scale=vs)


def test_nan_scale_checked_on_every_cpu_call():
    """CPU scale tensors are checked at every call (free), not only when the call is first seen."""
    q, k8, v8, ks, vs = _fp8_inputs()
    decode_attention(q, k8, v8, k_scale=ks, v_scale=vs)
    bad = ks.clone()
    bad[1] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        decode_attention(q, k8, v8, k_scale=bad, v_scale=vs)


def test_paged_kv_shard_in_fp8_quantizes_as_it_writes():
    """The generate back end's pools in fp8: the prefill fixes per-layer, per-head scales; later
    tokens are quantized with them (a value beyond the prefill's maximum saturates, not NaN); the
    pools decode against float64 on the dequantized cache."""
    from tree_attn.commands.generate.kv_store import PagedKVShard

    g = torch.Generator().manual_seed(4)
    store = PagedKVShard.allocate(2, 40, 2, 16, dtype=FN, device="cpu", page_size=8, seed=1)
    assert store.fp8 and store.k_scale == [None, None]
    with pytest.raises(ConfigError, match="no scales yet"):
        store.scales(0)
    k = torch.randn(30, 2, 16, generator=g) * torch.tensor([1.0, 5.0])[:, None]
    v = torch.randn(30, 2, 16, generator=g)
    for layer in range(2):
        store.write(layer, 0, k * (layer + 1), v)
    store.set_length(30)
    assert torch.equal(store.k_scale[1], 2 * store.k_scale[0])
    assert torch.equal(store.k_scale[0], k.abs().amax(dim=(0, 2)) / 448)
    new_k = torch.full((1, 2, 16), 1e4)  # far beyond the prefill's largest key
    store.write(0, 30, new_k, v[:1])
    store.set_length(31)
    assert torch.equal(store.k[0][store.block_table[0, 30 // 8].long(), 30 % 8].float(), torch.full((2, 16), 448.0))
    assert store.nbytes == 4 * 5 * 8 * 2 * 16 + 4 * 2 * 4  # four fp8 pools of 5 pages, four scale vectors
    q = torch.randn(1, 4, 16, generator=g).bfloat16()
    kk, vv = store.read(0)
    truth = _truth(q[:, None], dequantize(kk[None], store.k_scale[0]), dequantize(vv[None], store.v_scale[0]),
                   torch.tensor([31]))
    out, lse = decode_attention(q, store.k[0], store.v[0], seq_lens=store.seq_lens, block_table=store.block_table,
                                **store.scales(0))
    assert_decode_close(out[:, None], lse[:, None], *truth, TOL, what="paged store")
    plain = PagedKVShard.allocate(1, 8, 2, 16, dtype=torch.bfloat16, device="cpu")
    assert not plain.fp8 and plain.scales(0) == {}


@pytest.mark.parametrize("fmt", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("g", [1, 4, 8])
def test_nan_codes_propagate_as_in_the_float64_truth(fmt, g, c_kernel_path):
    """NaN codes in the cache (e4m3fn 0x7f/0xff, fnuz 0x80): a NaN key element makes its KV head's
    rows NaN, a NaN value element makes that output element NaN; everything else is unchanged. The
    C kernel's fast path checks each token's head vector for NaN codes and takes the exact path for
    it: the NaN pattern must equal the float64 truth's, on every path, with NaNs at token positions
    inside and outside groups of four."""
    hkv = 2
    q, k8, v8, ks, vs, _, _ = _case(1, 1, hkv * g, hkv, 64, 300, fmt=fmt, seed=g)
    nan_code = 0x80 if fmt == FNUZ else 0xFF
    kb, vb = k8.view(torch.uint8), v8.view(torch.uint8)
    kb[0, 5, 0, 3] = nan_code  # head 0's rows: NaN
    vb[0, 9, 1, 17] = 0x7F if fmt == FN else 0x80  # head 1's rows: element 17 NaN
    vb[0, 299, 1, 40] = nan_code  # the chunk's last token, past the groups of four
    ref_out, ref_lse = decode_attention_float64(q[:, 0], k8, v8, k_scale=ks, v_scale=vs)
    for native in ([True, False] if STATUS.available else [False]):
        out, lse = decode_attention_cpu(q[:, 0], k8, v8, native=native, k_scale=ks, v_scale=vs)
        assert torch.equal(torch.isnan(out), torch.isnan(ref_out)), native
        assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), native
        fin = ~torch.isnan(ref_out)
        assert bool(torch.isnan(ref_out[0, :g]).all()) and int(torch.isnan(ref_out[0, g:]).sum()) == 2 * g
        assert (out.double()[fin] - ref_out[fin]).abs().max() < 2e-2
