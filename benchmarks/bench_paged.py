"""Paged KV caches and several query tokens per row: what they cost against the contiguous,
one-token decode on the same tokens.

Columns (one row of B=1 by default, GQA 32/8 x 128, the Llama-3.1-8B attention shape):

- ``contig sq1``: ``decode_attention(q [B, Hq, D], k, v [B, N, Hkv, D])``, the baseline;
- ``paged sq1``: the same tokens in a shuffled pool of ``--block-size``-token pages;
- ``contig sqS causal`` / ``paged sqS causal``: ``q [B, S, Hq, D]``, causal, for each ``--sq``;
- ``S x sq1``: S one-token calls, what verifying S drafted tokens costs without folding them.

Each timed call is first checked against float64 (max abs error of out and lse). Times are medians
of ``--repeats`` interleaved rounds after ``--warmup`` (every round times every column in turn, so
drifting load from other processes hits them alike). On CPU tensors this times the torch CPU path
(``impl="torch"``), single-threaded by default, as a CPU rank runs it; with ``--device cuda`` the
Triton kernel, synchronised. Nothing here asserts a time.

    python benchmarks/bench_paged.py                       # CPU, 16K tokens, sq 4 and 16
    python benchmarks/bench_paged.py --device cuda --tokens 65536 --out bench_paged_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn import decode_attention
from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.kernels.reference import decode_attention_float64


def _paged(k, v, block_size, gen):
    """k, v [B, N, Hkv, D] into shuffled pools and an int32 block table (every token paged)."""
    b, n, hkv, d = k.shape
    per_row = -(-n // block_size)
    pad = per_row * block_size - n
    if pad:
        k = torch.cat([k, k.new_zeros(b, pad, hkv, d)], 1)
        v = torch.cat([v, v.new_zeros(b, pad, hkv, d)], 1)
    order = torch.randperm(b * per_row, generator=gen)
    k_pool = torch.empty(b * per_row, block_size, hkv, d, dtype=k.dtype)
    v_pool = torch.empty_like(k_pool)
    k_pool[order] = k.reshape(b * per_row, block_size, hkv, d)
    v_pool[order] = v.reshape(b * per_row, block_size, hkv, d)
    return k_pool, v_pool, order.view(b, per_row).to(torch.int32)


def _columns(args, dev):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, n = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.tokens
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    k = torch.randn(b, n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, n, hkv, d, generator=gen).to(dtype)
    lens = torch.full((b,), n, dtype=torch.int32)
    kp, vp, table = _paged(k, v, args.block_size, gen)
    impl = "torch" if dev.type == "cpu" else "triton"
    cols = {}
    q1 = torch.randn(b, hq, d, generator=gen).to(dtype)
    on = lambda *ts: [t.to(dev) for t in ts]
    kd, vd, kpd, vpd, td, ld, q1d = on(k, v, kp, vp, table, lens, q1)
    cols["contig sq1"] = (lambda: decode_attention(q1d, kd, vd, seq_lens=ld, impl=impl), (q1, k, v, lens, None, False))
    cols["paged sq1"] = (lambda: decode_attention(q1d, kpd, vpd, seq_lens=ld, block_table=td, impl=impl),
                         (q1, kp, vp, lens, table, False))
    for s in args.sq:
        qs = torch.randn(b, s, hq, d, generator=gen).to(dtype)
        (qsd,) = on(qs)
        cols[f"contig sq{s} causal"] = (
            lambda qsd=qsd: decode_attention(qsd, kd, vd, seq_lens=ld, impl=impl, causal=True),
            (qs, k, v, lens, None, True))
        cols[f"paged sq{s} causal"] = (
            lambda qsd=qsd: decode_attention(qsd, kpd, vpd, seq_lens=ld, block_table=td, impl=impl, causal=True),
            (qs, kp, vp, lens, table, True))
        cols[f"{s} x sq1"] = (
            lambda s=s: [decode_attention(q1d, kd, vd, seq_lens=ld, impl=impl) for _ in range(s)], None)
    return cols


def _error(fn, ref_args) -> float | None:
    if ref_args is None:
        return None
    q, k, v, lens, table, causal = ref_args
    out, lse = fn()
    ro, rl = decode_attention_float64(q, k, v, seq_lens=lens, block_table=table, causal=causal)
    return max((out.cpu().double() - ro).abs().max().item(), (lse.cpu().double() - rl).abs().max().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=16384, help="KV tokens per row")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (vLLM's default: 16)")
    p.add_argument("--sq", type=lambda s: [int(x) for x in s.split(",")], default=[4, 16],
                   help="query tokens per row, comma-separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    exit_if_unwritable(p, {"--out": args.out})
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_paged: --device cuda, but no CUDA or ROCm GPU is visible (--device cpu times the CPU paths)")
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    cols = _columns(args, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    errors = {name: _error(fn, ref) for name, (fn, ref) in cols.items()}
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in cols}
    for r in range(args.warmup + args.repeats):
        for name, (fn, _) in cols.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    load_after = os.getloadavg()[0]
    base = statistics.median(times["contig sq1"])
    device_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"device: {device_name}; load average before {load_before:.2f}, after {load_after:.2f}")
    print(f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype} tokens={args.tokens} "
          f"block_size={args.block_size} threads={args.threads if dev.type == 'cpu' else '-'} repeats={args.repeats}")
    print(f"{'column':<22}{'median ms':>10}{'x sq1':>8}{'max err':>10}")
    rows = []
    for name in cols:
        med = statistics.median(times[name])
        err = errors[name]
        print(f"{name:<22}{med:>10.2f}{med / base:>8.2f}{'' if err is None else f'{err:.1e}':>10}")
        rows.append(dict(column=name, median_ms=med, vs_sq1=med / base, max_err=err, times_ms=times[name]))
    if args.out:
        record = dict(device=device_name, args=vars(args), load=[load_before, load_after], rows=rows)
        atomic_write_text(args.out, json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
