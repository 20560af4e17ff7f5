"""The compiled Triton kernel on a GPU with paged KV and several query tokens per row, at Llama-3.1-8B
attention sizes (32 query heads, 8 KV heads, D=128, bf16), against float64 on out and lse; and the
CUDA-graph DecodeStep replaying with a block table rewritten between replays. Skipped without a
CUDA or ROCm GPU. (The small awkward cases of tests/kernels/test_paged_decode.py run compiled on
a GPU machine too: they take the ``device`` fixture.)"""

from __future__ import annotations

import pytest
import torch

from tests.paged_inputs import float64_over_shards, to_paged
from tests.tolerances import assert_decode_close, tol_for
from tree_attn import DecodeStep, decode_attention
from tree_attn.kernels.config import DecodeConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

HQ, HKV, D = 32, 8, 128


def _inputs(b, sq, n, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, HQ, D, generator=g).to(dtype)
    k = torch.randn(b, n, HKV, D, generator=g).to(dtype)
    v = torch.randn(b, n, HKV, D, generator=g).to(dtype)
    return q, k, v


# (block size, Sq, causal, config or None): vLLM's 16-token pages (a block id per key under the
# default 64-key tiles, one per tile under 16-key tiles), FlashAttention's 256, odd 17 and 1;
# speculative verification of 4 and 8 tokens.
GPU_CASES = [
    (16, 1, False, None),
    (16, 4, True, DecodeConfig(block_n=16, num_splits=8)),
    (256, 8, True, None),
    (17, 2, False, DecodeConfig(block_n=64, num_splits=4)),
    (1, 4, True, DecodeConfig(block_n=32, num_splits=2)),
]


@pytest.mark.parametrize("block_size,sq,causal,config", GPU_CASES,
                         ids=[f"bs{c[0]}-sq{c[1]}-{'causal' if c[2] else 'full'}" for c in GPU_CASES])
def test_compiled_paged_multi_token_matches_float64(block_size, sq, causal, config):
    lens = [4099, 0, 1500, 37]
    n = 4099 if block_size > 1 else 700
    lens = [min(x, n) for x in lens]
    q, k, v = _inputs(len(lens), sq, n, seed=block_size + sq)
    k, v, kp, vp, table = to_paged(k, v, lens, block_size, seed=block_size, share=True)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref_out, ref_lse = float64_over_shards(q, [(k, v, sl)], causal)
    out, lse = decode_attention(q.cuda(), kp.cuda(), vp.cuda(), seq_lens=sl.cuda(), block_table=table.cuda(),
                                causal=causal, config=config)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"),
                        what=f"bs{block_size} sq{sq}")
    c_out, c_lse = decode_attention(q.cuda(), k.cuda(), v.cuda(), seq_lens=sl.cuda(), causal=causal, config=config)
    assert_decode_close(out, lse, c_out, c_lse, tol_for(torch.bfloat16, device="cuda"), what="paged vs contiguous")


def test_decode_step_graph_replays_with_a_rewritten_block_table():
    q, k, v = _inputs(2, 4, 600, seed=3)
    k, v, kp, vp, table = to_paged(k, v, [600, 600], 16, seed=3)
    q_buf, sl, table_buf = q.cuda(), torch.tensor([300, 17], dtype=torch.int32, device="cuda"), table.cuda()
    step = DecodeStep(q_buf, kp.cuda(), vp.cuda(), sl, block_table=table_buf, causal=True)
    assert step.captured, step.why_eager
    for s, lens in enumerate(([300, 17], [301, 599], [600, 4])):
        flip = s == 2
        table_buf.copy_(table.flip(0) if flip else table)
        sl.copy_(torch.tensor(lens))
        q_buf.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(s)).to(q.dtype))
        out, lse = step()
        kk, vv = (k.flip(0), v.flip(0)) if flip else (k, v)
        ref_out, ref_lse = float64_over_shards(q_buf.cpu(), [(kk, vv, sl.cpu())], True)
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16, device="cuda"), what=f"replay {s}")
