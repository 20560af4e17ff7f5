"""The Triton kernel over fp8 KV caches (``float8_e4m3fn``, and AMD's ``float8_e4m3fnuz``) with
per-KV-head float32 scales, against float64 computed on the DEQUANTIZED cache (the stored values
times their head's scale, exactly): out and lse, at the bf16 tolerance (the kernel widens the
stored values exactly, so the only errors are its fp32 rounding and the weights entering the
P @ V dot in fp16, as for a 16-bit cache).

Runs on the GPU if there is one (compiled; skipped below compute capability 8.9, where Triton has
no e4m3), else in Triton's CPU interpreter (see conftest.py). The interpreter decodes both fp8
formats exactly, except their NaN encodings (it reads e4m3fn's 0x7f as 480 and e4m3fnuz's 0x80 as
-0): the NaN test is GPU-only. Shapes stay small for the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tests.decode_shapes import decode_cases
from tests.fp8_inputs import FP8_MAX, FP8_SHORT, dequantize, quantize
from tests.paged_inputs import float64_over_shards, to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn.errors import ConfigError, ShapeError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.triton_launch import TritonDecodeLaunch, decode_attention_triton, fp8_unsupported_reason

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
Q_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _qname(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


@pytest.fixture
def fp8_device(device):
    """The device fixture, for fp8: a CUDA GPU must have e4m3 (sm_89+)."""
    if device.type == "cuda" and torch.version.hip is None:
        reason = fp8_unsupported_reason(FN, "cuda", torch.cuda.get_device_capability(device))
        if reason:
            pytest.skip(reason)
    return device


def _formats(device) -> list[torch.dtype]:
    """e4m3fn everywhere; e4m3fnuz where the kernel takes it (ROCm, and the interpreter)."""
    return [FN] if device.type == "cuda" and torch.version.hip is None else [FN, FNUZ]


def _tol(q_dtype, device):
    """The bf16 row (its interpreter or GPU column): the issue's bound for fp8 against the
    dequantized float64 truth, whatever q's dtype."""
    return tol_for(q_dtype, torch.bfloat16, device=device)


def make_fp8(b, sq, hq, hkv, d, n, q_dtype, fmt, *, seed=0, per_head=True, head_gain=None):
    """q ``[B, Sq, Hq, D]`` (CPU, q_dtype); K/V quantized to ``fmt`` with scales ``[Hkv]``.

    ``head_gain``: ``(k_gain, v_gain)``, lists that multiply KV head h's keys and values before
    quantizing, so that the heads' scales differ (a scale read for the wrong head shows).
    Returns ``(q, k8, v8, k_scale, v_scale, k64, v64)`` with the dequantized float64 cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(q_dtype)
    k = torch.randn(b, n, hkv, d, generator=g) * 2.0
    v = torch.randn(b, n, hkv, d, generator=g)
    if head_gain is not None:
        k_gain, v_gain = (torch.tensor(x, dtype=torch.float32)[:, None] for x in head_gain)
        k, v = k * k_gain, v * v_gain
    k8, ks = quantize(k, fmt, per_head=per_head)
    v8, vs = quantize(v, fmt, per_head=per_head)
    return q, k8, v8, ks, vs, dequantize(k8, ks), dequantize(v8, vs)


def truth(q, k64, v64, lens, causal=False, scale=None):
    """float64 attention of ``q [B, Sq, Hq, D]`` over the dequantized cache (tests/paged_inputs)."""
    d = q.shape[-1]
    qd = q.double() if scale is None else q.double() * (scale / d**-0.5)
    return float64_over_shards(qd, [(k64, v64, lens)], causal)


def run(q, k8, v8, ks, vs, device, *, lens=None, config=None, table=None, causal=False, scale=None):
    """The kernel on ``device``; q ``[B, Sq, Hq, D]`` (Sq == 1 and not causal: passed as ``[B, Hq, D]``)."""
    one = q.shape[1] == 1 and not causal
    qq = (q[:, 0] if one else q).to(device)
    out, lse = decode_attention_triton(
        qq, k8.to(device), v8.to(device), seq_lens=None if lens is None else lens.to(device), scale=scale,
        config=config, block_table=None if table is None else table.to(device), causal=causal,
        k_scale=ks.to(device), v_scale=vs.to(device),
    )
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    if one:
        out, lse = out[:, None], lse[:, None]
    return out, lse


# (B, Hq, Hkv, D, N, lens or None, config): what each line exercises.
CASES = {
    "gqa4_d64_n_not_multiple_of_block": (2, 8, 2, 64, 100, None, DecodeConfig(block_n=32, num_splits=3)),
    "mha_d80_single_split_direct_write": (1, 2, 2, 80, 37, [37], DecodeConfig(block_n=16, num_splits=1)),
    "gqa8_d128_rows_of_length_0": (3, 8, 1, 128, 50, [50, 0, 17], DecodeConfig(block_n=16, num_splits=3)),
    "gqa4_d128_default_config": (2, 8, 2, 128, 70, [70, 33], None),
    "gqa1_d64_many_splits": (1, 4, 4, 64, 130, None, DecodeConfig(block_n=16, num_splits=9)),
}


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=_qname)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_float64_on_dequantized_cache(case, q_dtype, fp8_device):
    b, hq, hkv, d, n, lens, config = CASES[case]
    for fmt in _formats(fp8_device):
        q, k8, v8, ks, vs, k64, v64 = make_fp8(b, 1, hq, hkv, d, n, q_dtype, fmt, seed=list(CASES).index(case))
        sl = torch.tensor(lens if lens is not None else [n] * b, dtype=torch.int32)
        out, lse = run(q, k8, v8, ks, vs, fp8_device, lens=None if lens is None else sl, config=config)
        o64, l64 = truth(q, k64, v64, sl)
        assert_decode_close(out, lse, o64, l64, _tol(q_dtype, fp8_device), what=f"{case} q {q_dtype} {FP8_SHORT[fmt]}")


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head_scales", "scalar_scale_expanded"])
def test_scales_per_kv_head(per_head, fp8_device):
    """KV heads whose values differ by up to 400x (so do their scales): each program must read its
    own head's k_scale and v_scale. With one scalar scale (expanded to [Hkv]) the small heads keep
    fewer bits, which the truth on the dequantized cache accounts for exactly."""
    gain = ([1e-2, 1.0, 0.5, 2.0], [4.0, 1.0, 0.25, 1e-2])
    q, k8, v8, ks, vs, k64, v64 = make_fp8(2, 1, 8, 4, 64, 45, torch.bfloat16, FN, seed=5, per_head=per_head,
                                           head_gain=gain)
    assert per_head == (ks.unique().numel() == 4)
    lens = torch.tensor([45, 20], dtype=torch.int32)
    for config in (DecodeConfig(block_n=16, num_splits=3), DecodeConfig(block_n=32, num_splits=1)):
        out, lse = run(q, k8, v8, ks, vs, fp8_device, lens=lens, config=config)
        o64, l64 = truth(q, k64, v64, lens)
        assert_decode_close(out, lse, o64, l64, _tol(torch.bfloat16, fp8_device), what=f"{config.describe()}")
    # The scales are used, per head: the same stored values with head 0's scales everywhere differ.
    wrong_k, wrong_v = ks[:1].expand(4).contiguous(), vs[:1].expand(4).contiguous()
    if per_head:
        _out_w, lse_w = run(q, k8, v8, wrong_k, wrong_v, fp8_device, lens=lens, config=config)
        assert not torch.allclose(lse_w.cpu(), lse.cpu(), atol=1e-2)


def test_v_scale_scales_out_only(fp8_device):
    """v_scale multiplies the normalised output at the end: doubling it doubles out bit for bit
    and leaves lse bit for bit (the weights do not depend on V); k_scale changes lse."""
    q, k8, v8, ks, vs, _k64, _v64 = make_fp8(2, 1, 8, 2, 64, 40, torch.float32, FN, seed=7)
    lens = torch.tensor([40, 13], dtype=torch.int32)
    cfg = DecodeConfig(block_n=16, num_splits=2)
    out, lse = run(q, k8, v8, ks, vs, fp8_device, lens=lens, config=cfg)
    out2, lse2 = run(q, k8, v8, ks, vs * 2, fp8_device, lens=lens, config=cfg)
    assert torch.equal(lse2, lse) and torch.equal(out2, out * 2)
    _, lse3 = run(q, k8, v8, ks * 2, vs, fp8_device, lens=lens, config=cfg)
    assert not torch.equal(lse3, lse)


@pytest.mark.parametrize("block_size", [1, 3, 16, 17, 32, 256])
def test_paged_pools(block_size, fp8_device):
    """fp8 pools at block sizes that hold whole tiles (16, 32, 256: one block id per tile) and
    others (1, 3, 17: a per-key gather), shuffled pages, GQA 4, a row of length 0; unread pool
    entries hold NaN (the interpreter reads e4m3fn NaN as 480, which would show as well)."""
    b, hq, hkv, d, n = 3, 8, 2, 64, 300 if block_size == 256 else 40
    lens = [n, 0, n // 2 + 1]
    for fmt in _formats(fp8_device):
        q, k8, v8, ks, vs, _, _ = make_fp8(b, 1, hq, hkv, d, n, torch.bfloat16, fmt, seed=block_size)
        k8, v8, kp, vp, table = to_paged(k8, v8, lens, block_size, seed=block_size)
        sl = torch.tensor(lens, dtype=torch.int32)
        o64, l64 = truth(q, dequantize(k8, ks), dequantize(v8, vs), sl)
        for config in (DecodeConfig(block_n=16, num_splits=2), DecodeConfig(block_n=32, num_splits=1)):
            out, lse = run(q, kp, vp, ks, vs, fp8_device, lens=sl, config=config, table=table)
            assert_decode_close(out, lse, o64, l64, _tol(torch.bfloat16, fp8_device),
                                what=f"paged bs={block_size} {config.describe()} {FP8_SHORT[fmt]}")


# (Sq, causal, paged block size or None, q dtype)
MULTI = [(2, True, None, torch.bfloat16), (5, True, 3, torch.float16), (5, False, 16, torch.float32),
         (16, True, None, torch.float32), (16, True, 17, torch.bfloat16), (8, False, None, torch.float16)]


@pytest.mark.parametrize("sq,causal,block_size,q_dtype", MULTI,
                         ids=[f"sq{s}-{'causal' if c else 'full'}-{'bs' + str(b) if b else 'contig'}-{_qname(t)}"
                              for s, c, b, t in MULTI])
def test_several_query_tokens(sq, causal, block_size, q_dtype, fp8_device):
    """q [B, Sq, Hq, D] over fp8, causal or not, contiguous and paged; rows shorter than Sq (some
    tokens see no key under causal) and a row of length 0; GQA 4, D=80."""
    b, hq, hkv, d, n = 3, 8, 2, 80, 30
    lens = [30, 0, 3]
    q, k8, v8, ks, vs, _, _ = make_fp8(b, sq, hq, hkv, d, n, q_dtype, FN, seed=sq + 7 * causal)
    sl = torch.tensor(lens, dtype=torch.int32)
    table = None
    kk, vv = k8, v8
    if block_size:
        k8, v8, kk, vv, table = to_paged(k8, v8, lens, block_size, seed=sq)
    o64, l64 = truth(q, dequantize(k8, ks), dequantize(v8, vs), sl, causal)
    out, lse = run(q, kk, vv, ks, vs, fp8_device, lens=sl, config=DecodeConfig(block_n=16, num_splits=2),
                   table=table, causal=causal)
    assert out.shape == (b, sq, hq, d)
    assert_decode_close(out, lse, o64, l64, _tol(q_dtype, fp8_device), what=f"sq={sq} causal={causal} bs={block_size}")


def test_every_finite_fp8_value_and_a_custom_scale(fp8_device):
    """The cache holds every finite value of the format (subnormals, +-0 and the largest included)
    in K and V: the widening must be exact for all of them. The values are shuffled over 4 rows
    of 64 keys x D=64, stored values times 1/max (so the cache lies in [-1, 1]); scale 0.05."""
    for fmt in _formats(fp8_device):
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
        finite = bits[torch.isfinite(bits.float())]
        g = torch.Generator().manual_seed(3)
        b, hkv, d, n = 4, 1, 64, 64
        idx = torch.randint(0, finite.numel(), (2, b, n, hkv, d), generator=g)
        k8, v8 = finite[idx[0]], finite[idx[1]]
        ks = vs = torch.tensor([1.0 / FP8_MAX[fmt]])  # values in [-1, 1]
        q = (torch.randn(b, 1, 4, d, generator=g) * 0.5).to(torch.float32)
        out, lse = run(q, k8, v8, ks, vs, fp8_device, config=DecodeConfig(block_n=16, num_splits=3), scale=0.05)
        lens = torch.full((b,), n, dtype=torch.int32)
        o64, l64 = truth(q, dequantize(k8, ks), dequantize(v8, vs), lens, scale=0.05)
        assert_decode_close(out, lse, o64, l64, _tol(torch.float32, fp8_device),
                            what=f"every finite {FP8_SHORT[fmt]} value")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the interpreter does not decode fp8 NaN")
def test_nan_in_the_cache_gives_nan_rows(fp8_device):
    """An fp8 NaN inside a row's length makes that row NaN (as any NaN data does), and only it."""
    q, k8, v8, ks, vs, _, _ = make_fp8(2, 1, 4, 1, 64, 40, torch.bfloat16, FN, seed=9)
    k8[0, 5, 0, 3] = float("nan")
    _out, lse = run(q, k8, v8, ks, vs, fp8_device, config=DecodeConfig(block_n=16, num_splits=2))
    assert torch.isnan(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_scales_are_read_at_every_call(fp8_device):
    """A prepared launch reads the scales' values when it runs, not when it is built: updating
    them in place (as a CUDA-graph replay would see) changes the result accordingly."""
    q, k8, v8, ks, vs, k64, v64 = make_fp8(1, 1, 4, 2, 64, 33, torch.float16, FN, seed=11)
    dev = fp8_device
    q3, k8d, v8d = q[:, 0].to(dev), k8.to(dev), v8.to(dev)
    ksd, vsd = ks.to(dev), vs.to(dev)
    launch = TritonDecodeLaunch(q3, k8d, v8d, None, config=DecodeConfig(block_n=16, num_splits=2), k_scale=ksd,
                                v_scale=vsd)
    out, lse = launch.new_outputs()
    lens = torch.tensor([33], dtype=torch.int32)
    for factor in (1.0, 0.25):
        ksd.copy_(ks * factor)
        vsd.copy_(vs * factor)
        launch(q3, k8d, v8d, None, out, lse, k_scale=ksd, v_scale=vsd)
        o64, l64 = truth(q, k64 * factor, v64 * factor, lens)
        assert_decode_close(out[:, None], lse[:, None], o64, l64, _tol(torch.float16, dev), what=f"scales x{factor}")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=decode_cases(groups=[1, 4, 8], head_dims=[16, 48, 64, 80], max_splits=5), q_dtype=st.sampled_from(Q_DTYPES))
def test_random_shapes(c, q_dtype, fp8_device):
    q, k8, v8, ks, vs, k64, v64 = make_fp8(c.b, 1, c.hkv * c.group, c.hkv, c.d, c.n, q_dtype, FN, seed=c.n * 7 + c.d)
    sl = torch.tensor(c.lens, dtype=torch.int32)
    config = DecodeConfig(block_n=c.block_n, num_splits=c.splits)
    out, lse = run(q, k8, v8, ks, vs, fp8_device, lens=sl, config=config)
    o64, l64 = truth(q, k64, v64, sl)
    assert_decode_close(out, lse, o64, l64, _tol(q_dtype, fp8_device), what=f"random {c} {q_dtype}")


def test_bad_scales_and_formats_are_config_errors(fp8_device):
    """The launcher's own checks (the dispatch layer checks values and expands scalars first)."""
    device = fp8_device
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=device)
    k8 = torch.zeros(1, 8, 2, 64, dtype=FN, device=device)
    one = torch.ones(2, device=device)
    with pytest.raises(ConfigError, match="needs both k_scale and v_scale"):
        TritonDecodeLaunch(q, k8, k8, None, k_scale=one)
    kb = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ConfigError, match="k_scale/v_scale are for fp8 caches"):
        TritonDecodeLaunch(q, kb, kb, None, k_scale=one, v_scale=one)
    with pytest.raises(ConfigError, match=r"float32 tensor \[Hkv\] = \[2\]"):
        TritonDecodeLaunch(q, k8, k8, None, k_scale=torch.ones(1, device=device), v_scale=one)
    with pytest.raises(ConfigError, match=r"float32 tensor \[Hkv\] = \[2\]"):
        TritonDecodeLaunch(q, k8, k8, None, k_scale=one.double(), v_scale=one)
    with pytest.raises(ConfigError, match="contiguous"):
        TritonDecodeLaunch(q, k8, k8, None, k_scale=torch.ones(4, device=device)[::2], v_scale=one)
    with pytest.raises(ShapeError, match="q must be float16, bfloat16 or float32"):
        TritonDecodeLaunch(k8[:, 0], k8, k8, None, k_scale=one, v_scale=one)
    with pytest.raises(ShapeError, match="k and v must share a dtype"):
        TritonDecodeLaunch(q, k8, kb, None, k_scale=one, v_scale=one)
    launch = TritonDecodeLaunch(q, k8, k8, None, k_scale=one, v_scale=one,
                                config=DecodeConfig(block_n=16, num_splits=1))
    out, lse = launch.new_outputs()
    with pytest.raises(ConfigError, match="pass its k_scale and v_scale"):
        launch(q, k8, k8, None, out, lse)
    # Where the kernel cannot take fp8: planned for a GPU target from CPU tensors, no GPU needed.
    qc, kc = q.cpu(), k8.cpu()
    with pytest.raises(ConfigError, match="float8_e4m3fnuz .* run on ROCm GPUs only"):
        TritonDecodeLaunch(qc, kc.view(FNUZ), kc.view(FNUZ), None, k_scale=one.cpu(), v_scale=one.cpu(), backend="cuda")
    TritonDecodeLaunch(qc, kc.view(FNUZ), kc.view(FNUZ), None, k_scale=one.cpu(), v_scale=one.cpu(), backend="hip")
    assert "compute capability 8.9 or newer" in fp8_unsupported_reason(FN, "cuda", (8, 0))
    assert fp8_unsupported_reason(FN, "cuda", (8, 9)) is None and fp8_unsupported_reason(FN, "cuda", (9, 0)) is None
    assert fp8_unsupported_reason(FNUZ, "hip") is None and fp8_unsupported_reason(FN, "hip") is None
