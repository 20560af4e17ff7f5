"""fp8 KV caches through the public API on a real GPU: ``decode_attention`` (contiguous and paged,
per-head and scalar scales, ``impl="triton"`` and ``impl="torch"``), ``DecodeStep`` replayed as a
CUDA graph with its scales updated in place, and ``tree_decode`` on one rank, against float64 on
the dequantized cache, out and lse, at the bf16 tolerance. Then the refusals: scales on the wrong
device, and a NaN scale (checked once when the signature is prepared). Skipped without a GPU and
on NVIDIA GPUs below compute capability 8.9 (CPU tests of the same paths: tests/unit/test_fp8_cpu.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.fp8_inputs import dequantize, quantize
from tests.paged_inputs import float64_over_shards, to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn import DecodeStep, decode_attention
from tree_attn.errors import ConfigError


def _fp8_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA or ROCm GPU"
    if torch.version.hip is not None:
        return "ROCm takes float8_e4m3fnuz caches only (kernels/fp8.ROCM_FP8_DTYPES); this test uses e4m3fn"
    from tree_attn.kernels.triton_launch import fp8_unsupported_reason

    return fp8_unsupported_reason(torch.float8_e4m3fn, "cuda", torch.cuda.get_device_capability())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_fp8_reason() is not None, reason=str(_fp8_reason()))]

TOL = tol_for(torch.bfloat16, device="cuda")


def _case(b=2, n=3000, hq=32, hkv=8, d=128, seed=0, per_head=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    k = torch.randn(b, n, hkv, d, generator=g) * (torch.rand(hkv, generator=g) * 3 + 0.1)[:, None]
    v = torch.randn(b, n, hkv, d, generator=g)
    k8, ks = quantize(k, per_head=per_head)
    v8, vs = quantize(v, per_head=per_head)
    return q, k8, v8, ks, vs


def _truth(q, k8, v8, ks, vs, lens):
    return float64_over_shards(q[:, None].double(), [(dequantize(k8, ks), dequantize(v8, vs), lens)], False)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("scales", ["per_head", "python_number"])
def test_decode_attention_fp8_on_gpu(impl, scales):
    q, k8, v8, ks, vs = _case(per_head=scales == "per_head", seed=1)
    lens = torch.tensor([3000, 1234], dtype=torch.int32)
    o64, l64 = _truth(q, k8, v8, ks, vs, lens)
    kw = ({"k_scale": ks.cuda(), "v_scale": vs.cuda()} if scales == "per_head"
          else {"k_scale": float(ks[0]), "v_scale": float(vs[0])})
    out, lse = decode_attention(q.cuda(), k8.cuda(), v8.cuda(), seq_lens=lens.cuda(), impl=impl, **kw)
    assert_decode_close(out[:, None], lse[:, None], o64, l64, TOL, what=f"{impl} {scales}")


def test_paged_fp8_on_gpu():
    q, k8, v8, ks, vs = _case(n=700, seed=2)
    lens = [700, 333]
    _, _, kp, vp, table = to_paged(k8, v8, lens, 16, seed=2)
    lt = torch.tensor(lens, dtype=torch.int32)
    out, lse = decode_attention(q.cuda(), kp.cuda(), vp.cuda(), seq_lens=lt.cuda(), block_table=table.cuda(),
                                k_scale=ks.cuda(), v_scale=vs.cuda())
    assert_decode_close(out[:, None], lse[:, None], *_truth(q, k8, v8, ks, vs, lt), TOL, what="paged")


def test_decode_step_graph_reads_scales_at_every_replay():
    q, k8, v8, ks, vs = _case(n=2048, seed=3)
    lens = torch.tensor([2048, 2048], dtype=torch.int32)
    ks_d, vs_d = ks.cuda(), vs.cuda()
    with DecodeStep(q.cuda(), k8.cuda(), v8.cuda(), lens.cuda(), k_scale=ks_d, v_scale=vs_d) as step:
        out, lse = step()
        step.wait()
        assert_decode_close(out[:, None], lse[:, None], *_truth(q, k8, v8, ks, vs, lens), TOL, what="step")
        ks_d.mul_(1.5)
        vs_d.mul_(0.25)
        out, lse = step()
        step.wait()
        assert_decode_close(out[:, None], lse[:, None], *_truth(q, k8, v8, ks * 1.5, vs * 0.25, lens), TOL,
                            what=f"step after in-place update (captured: {step.captured})")


def test_bad_scales_on_gpu():
    q, k8, v8, ks, vs = _case(n=64, seed=4)
    q, k8, v8 = q.cuda(), k8.cuda(), v8.cuda()
    with pytest.raises(ConfigError, match="must be on the cache's device"):
        decode_attention(q, k8, v8, k_scale=ks, v_scale=vs.cuda())
    bad = ks.clone()
    bad[3] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        decode_attention(q, k8, v8, k_scale=bad.cuda(), v_scale=vs.cuda())
