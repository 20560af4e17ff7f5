"""The compiled Triton kernel on a real GPU at realistic sizes (Llama-3.1-8B attention: 32 query
heads, 8 KV heads, head dim 128, bf16). Skipped without a CUDA or ROCm GPU."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import assert_decode_close, tol_for
from tree_attn.cost.devices import DeviceSpec
from tree_attn.cost.kernel import candidate_configs, rank_candidates
from tree_attn.errors import ConfigError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.dispatch import decode_attention
from tree_attn.kernels.reference import decode_attention_float64, decode_attention_torch
from tree_attn.kernels.shapes import DecodeShape
from tree_attn.kernels.triton_launch import decode_attention_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

HQ, HKV, D = 32, 8, 128


def _free_bytes() -> int:
    torch.cuda.empty_cache()  # memory cached by earlier tests is free for this one
    free, _ = torch.cuda.mem_get_info()
    return free


def _llama_inputs(b, n, dtype=torch.bfloat16, seed=0):
    need = 2 * b * n * HKV * D * torch.tensor([], dtype=dtype).element_size()
    if need * 1.6 > _free_bytes():  # K, V, plus the reference's float32 chunks and slack
        pytest.skip(f"needs ~{need * 1.6 / 2**30:.1f} GiB of GPU memory")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, HQ, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, n, HKV, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, n, HKV, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


@pytest.mark.parametrize("b,n", [(1, 4096), (1, 65536 + 37), (1, 262144), (4, 131072 - 5), (8, 262144)])
def test_llama_shape_default_config_matches_reference(b, n):
    q, k, v = _llama_inputs(b, n)
    lens = torch.randint(0, n + 1, (b,), device="cuda")
    lens[0] = n
    out, lse = decode_attention(q, k, v, seq_lens=lens)  # impl="auto" -> Triton on GPU tensors
    ref_out, ref_lse = decode_attention_torch(q, k, v, seq_lens=lens)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"), what=f"b{b} n{n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_float64_ground_truth_moderate_size(dtype, d):
    g = torch.Generator(device="cuda").manual_seed(d)
    b, hq, hkv, n = 3, 16, 4, 8191
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=dtype, generator=g)
    lens = torch.tensor([n, 0, 1000], device="cuda")
    row_bytes = d * q.element_size()
    # A deeper pipeline with 8 warps, sized to fit even a 100 KiB-shared-memory card.
    deep = DecodeConfig(
        block_n=32 if row_bytes <= 256 else 16, num_warps=8, num_stages=3 if row_bytes <= 256 else 2, num_splits=1
    )
    for cfg in (None, DecodeConfig(block_n=32 if row_bytes <= 512 else 16, num_splits=7), deep):
        out, lse = decode_attention_triton(q, k, v, seq_lens=lens, config=cfg)
        o64, l64 = decode_attention_float64(q, k, v, seq_lens=lens)
        assert_decode_close(out, lse, o64, l64, tol_for(dtype, device="cuda"), what=f"{dtype} d{d} {cfg}")


MIXED = [(torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
         (torch.float32, torch.float16)]


@pytest.mark.parametrize("q_dtype,kv_dtype", MIXED, ids=[f"q_{str(a)[6:]}-kv_{str(b)[6:]}" for a, b in MIXED])
@pytest.mark.parametrize("group", [4, 64])
def test_mixed_dtypes_default_config_at_llama_size(q_dtype, kv_dtype, group):
    """A query in another dtype than the 16-bit cache, with the default config (tensor-core dots,
    q and the weights in parts of the cache's dtype; 64 query rows too): against float64 with the
    query dtype's tolerance. Scores of ~5 (q scaled by 2)."""
    b, n, hkv = 2, 16384 + 37, 8 if group == 4 else 1
    g = torch.Generator(device="cuda").manual_seed(group)
    q = (torch.randn(b, hkv * group, D, device="cuda", generator=g) * 2).to(q_dtype)
    k = torch.randn(b, n, hkv, D, device="cuda", generator=g).to(kv_dtype)
    v = torch.randn(b, n, hkv, D, device="cuda", generator=g).to(kv_dtype)
    lens = torch.tensor([n, 5000], device="cuda")
    out, lse = decode_attention(q, k, v, seq_lens=lens)
    o64, l64 = decode_attention_float64(q, k, v, seq_lens=lens)
    assert out.dtype == q_dtype
    assert_decode_close(out, lse, o64, l64, tol_for(q_dtype, device="cuda"),
                        what=f"q {q_dtype} over {kv_dtype}, group {group}")


def test_config_too_big_for_the_device_is_a_config_error():
    q, k, v = _llama_inputs(1, 4096)
    with pytest.raises(ConfigError, match="shared memory"):
        decode_attention_triton(q, k, v, config=DecodeConfig(block_n=256, num_stages=8, num_splits=4))


def test_top_ranked_candidates_compile_and_agree():
    """The configs tune would time first all compile on this GPU and give the same answer."""
    b, n = 2, 65536
    q, k, v = _llama_inputs(b, n, seed=3)
    shape = DecodeShape(b, HQ, HKV, D, n)
    spec = DeviceSpec.from_torch_device(q.device)
    ranked = rank_candidates(candidate_configs(shape, q.dtype, spec), shape, q.dtype, spec, top_k=12)
    ref_out, ref_lse = decode_attention_torch(q, k, v)
    too_big = []
    for r in ranked:
        try:
            out, lse = decode_attention_triton(q, k, v, config=r.config)
        except ConfigError:  # the model's shared-memory estimate let through a config that does not fit
            too_big.append(r.config.describe())
            continue
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"),
                            what=r.config.describe())
    assert len(too_big) <= len(ranked) // 4, f"too many top candidates do not fit: {too_big}"


def test_int64_offsets_multi_gigabyte_cache():
    """Row offsets past 2^31 elements, with strides that still fit int32.

    3 rows x 1M keys x 8 heads x 128: the batch stride is 2^30 elements, an int32 argument, and row
    2 starts at element 2^31, so only the kernel's own 64-bit base arithmetic reaches it. (With a
    stride of 2^31 or more Triton passes it as int64 and the test would prove nothing.)
    """
    b, n = 3, 1 << 20
    q, k, v = _llama_inputs(b, n, seed=4)
    assert k.stride(0) < 2**31 <= 2 * k.stride(0)
    out, lse = decode_attention_triton(q, k, v, config=DecodeConfig(block_n=64, num_splits=64))
    for row in (0, 2):  # row 0 as a control; row 2 is where int32 offsets would wrap
        ref_out, ref_lse = decode_attention_torch(q[row : row + 1], k[row : row + 1], v[row : row + 1])
        assert_decode_close(
            out[row : row + 1], lse[row : row + 1], ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"),
            what=f"row {row} of 1M keys"
        )


def test_noncontiguous_cache_slices_on_gpu():
    cache_k = torch.randn(2, 10000, HKV, D, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn(2, HKV, 10000, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = cache_k[:, 17:9000]
    v = cache_v.permute(0, 2, 1, 3)[:, 17:9000]
    out, lse = decode_attention_triton(q, k, v)
    ref_out, ref_lse = decode_attention_torch(q, k, v)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"), what="strided cache")
