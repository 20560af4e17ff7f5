"""The compiled Triton kernel over fp8 KV caches on a real GPU, at Llama-3.1-8B attention sizes
(32 query heads, 8 KV heads, D=128) and an MQA-like group, with the default configs: against
float64 (moderate N) or fp32 (long N) computed on the DEQUANTIZED cache, out and lse, at the bf16
tolerance. Skipped without a GPU, and on NVIDIA GPUs below compute capability 8.9 (no e4m3 in
Triton there)."""

from __future__ import annotations

import pytest
import torch

from tests.fp8_inputs import quantize
from tests.paged_inputs import to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.reference import decode_attention_torch
from tree_attn.kernels.triton_launch import TritonDecodeLaunch, decode_attention_triton, fp8_unsupported_reason


def _fp8_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA or ROCm GPU"
    if torch.version.hip is None:
        return fp8_unsupported_reason(torch.float8_e4m3fn, "cuda", torch.cuda.get_device_capability())
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_fp8_reason() is not None, reason=str(_fp8_reason()))]

HQ, HKV, D = 32, 8, 128
TOL = tol_for(torch.bfloat16, device="cuda")


def _inputs(b, n, hq=HQ, hkv=HKV, d=D, sq=0, q_dtype=torch.bfloat16, seed=0):
    """q, and an fp8 cache quantized per KV head from bf16 random values, on the GPU."""
    need = 2 * b * n * hkv * d * (1 + 4)  # the fp8 cache and its float32 dequantized copy
    torch.cuda.empty_cache()
    if need * 1.5 > torch.cuda.mem_get_info()[0]:
        pytest.skip(f"needs ~{need * 1.5 / 2**30:.1f} GiB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_shape = (b, sq, hq, d) if sq else (b, hq, d)
    q = torch.randn(q_shape, device="cuda", generator=g)
    k = torch.randn(b, n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k8, ks = quantize(k, torch.float8_e4m3fn)
    v8, vs = quantize(v, torch.float8_e4m3fn)
    return q.to(q_dtype), k8, v8, ks, vs


def _fp32_truth(q, k8, v8, ks, vs, lens, **kw):
    """The torch reference (fp32 arithmetic) on the dequantized cache, rounded to fp32 (an error
    of 2^-24 relative per element, far below the tolerance)."""
    k32, v32 = k8.float() * ks[:, None], v8.float() * vs[:, None]
    out, lse = decode_attention_torch(q.float(), k32, v32, seq_lens=lens, **kw)
    return out, lse


@pytest.mark.parametrize("b,n", [(1, 4096), (1, 65536 + 37), (4, 131072 - 5), (8, 32768)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_llama_default_config(b, n, q_dtype):
    q, k8, v8, ks, vs = _inputs(b, n, q_dtype=q_dtype, seed=n)
    lens = torch.randint(0, n + 1, (b,), device="cuda")
    lens[0] = n
    out, lse = decode_attention_triton(q, k8, v8, seq_lens=lens, k_scale=ks, v_scale=vs)
    assert out.dtype == q_dtype
    ref_out, ref_lse = _fp32_truth(q, k8, v8, ks, vs, lens)
    assert_decode_close(out, lse, ref_out, ref_lse, TOL, what=f"fp8 b{b} n{n} q {q_dtype}")


@pytest.mark.parametrize("group,d", [(64, 128), (4, 64), (4, 80), (4, 256)])
def test_groups_and_head_dims(group, d):
    """An MQA-like 64-head group (wgmma on Hopper) and head dims 64/80/256, default and explicit configs."""
    hkv = 1 if group == 64 else 4
    q, k8, v8, ks, vs = _inputs(3, 8191, hq=group * hkv, hkv=hkv, d=d, seed=group + d)
    lens = torch.tensor([8191, 0, 1000], device="cuda")
    ref_out, ref_lse = _fp32_truth(q, k8, v8, ks, vs, lens)
    for cfg in (None, DecodeConfig(block_n=32, num_splits=7),
                DecodeConfig(block_n=16, num_warps=8, num_stages=3, num_splits=1)):
        out, lse = decode_attention_triton(q, k8, v8, seq_lens=lens, config=cfg, k_scale=ks, v_scale=vs)
        assert_decode_close(out, lse, ref_out, ref_lse, TOL, what=f"fp8 group {group} d{d} {cfg}")


@pytest.mark.parametrize("block_size", [1, 16, 17, 256])
def test_paged_default_config(block_size):
    b, n = 4, 8192
    q, k8, v8, ks, vs = _inputs(b, n, seed=block_size)
    lens = [n, 1, 4097, 0]
    k8c, v8c, kp, vp, table = to_paged(k8.cpu(), v8.cpu(), lens, block_size, seed=block_size)
    sl = torch.tensor(lens, device="cuda")
    out, lse = decode_attention_triton(q, kp.cuda(), vp.cuda(), seq_lens=sl, block_table=table.cuda(), k_scale=ks,
                                       v_scale=vs)
    ref_out, ref_lse = _fp32_truth(q, k8c.cuda(), v8c.cuda(), ks, vs, sl)
    assert_decode_close(out, lse, ref_out, ref_lse, TOL, what=f"fp8 paged bs={block_size}")


@pytest.mark.parametrize("sq", [4, 16])
def test_several_query_tokens_causal(sq):
    b, n = 2, 16384
    q, k8, v8, ks, vs = _inputs(b, n, sq=sq, seed=sq)
    lens = torch.tensor([n, 9], device="cuda")
    out, lse = decode_attention_triton(q, k8, v8, seq_lens=lens, causal=True, k_scale=ks, v_scale=vs)
    ref_out, ref_lse = _fp32_truth(q, k8, v8, ks, vs, lens, causal=True)
    assert_decode_close(out, lse, ref_out, ref_lse, TOL, what=f"fp8 sq={sq} causal")


def test_graph_replay_reads_the_scales_in_place():
    """A CUDA graph of the launch reads the scales' current values at every replay."""
    q, k8, v8, ks, vs = _inputs(1, 20000, seed=3)
    ksd, vsd = ks.clone(), vs.clone()
    launch = TritonDecodeLaunch(q, k8, v8, None, k_scale=ksd, v_scale=vsd)
    out, lse = launch.new_outputs()
    launch(q, k8, v8, None, out, lse, k_scale=ksd, v_scale=vsd)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q, k8, v8, None, out, lse, k_scale=ksd, v_scale=vsd)
    for factor in (1.0, 0.5):
        ksd.copy_(ks * factor)
        vsd.copy_(vs * factor)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _fp32_truth(q, k8, v8, ks * factor, vs * factor, None)
        assert_decode_close(out, lse, ref_out, ref_lse, TOL, what=f"replay, scales x{factor}")
