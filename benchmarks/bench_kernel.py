#!/usr/bin/env python
"""Bandwidth benchmark of the Triton split-KV decode kernel against torch SDPA (GPU only).

Shape: Llama-3.1-8B attention (32 query heads, 8 KV heads, head dim 128, bf16), one new query per
row, batch 1-16, KV length 4K-1M per GPU (combinations that do not fit in memory are skipped).

For each point: the median time per call (CUDA events around batches of back-to-back calls, after
warm-up), achieved bandwidth = K+V bytes read / time, and the fraction of this card's measured
device-to-device copy bandwidth (a large ``Tensor.copy_``, counted as bytes read + bytes written).
Consecutive calls read different input buffers, together at least 3x the L2 cache, so L2 never
serves the KV cache; no cache flush runs between calls (a flush right before a timed kernel leaves
dirty lines whose write-back the kernel would pay for). The host's time to issue one call is
reported beside it: where it reaches the GPU time, the figure is bound by Python, not the kernel.
The baseline is ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors: q as
``[B, Hq, 1, D]``, K/V as transposed *views* ``[B, Hkv, N, D]`` of the ``[B, N, Hkv, D]`` cache with
``enable_gqa=True`` (or, on a torch without it, K/V with heads repeated: the table says which).

Goals reported against (never asserted): >= 85% of copy bandwidth for N >= 64K, and >= 2x faster
than SDPA at batch 1 for N >= 64K.

Usage:
    python benchmarks/bench_kernel.py [--quick] [--out results.json] [--batches 1,4] [--lens 4096,65536]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# Run from a checkout without installing: make the repository root importable.
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

HQ, HKV, HEAD_DIM = 32, 8, 128
FULL_BATCHES = [1, 2, 4, 8, 16]
FULL_LENS = [4096, 16384, 65536, 262144, 1048576]
QUICK_BATCHES = [1, 8]
QUICK_LENS = [4096, 65536, 262144]
GOAL_FRACTION = 0.85
GOAL_SPEEDUP = 2.0
GOAL_MIN_LEN = 65536


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        elif part.endswith("m"):
            mult, part = 1024 * 1024, part[:-1]
        out.append(int(part) * mult)
    return out


@dataclass
class Timing:
    """Per-call times of a function called back to back: median GPU time and host issue time."""

    gpu_us: float
    host_us: float
    calls: int


def time_calls(torch, fn, *, warmup: int = 20, rep_ms: float = 200.0, min_batch_ms: float = 2.0) -> Timing:
    """Time ``fn(i)`` (i = call number) in batches of back-to-back calls between two CUDA events.

    Returns the median over batches of (batch GPU time / calls), and the host's mean time to issue
    one call. At least 5 batches, each of about ``min_batch_ms``, until ``rep_ms`` is spent.
    """
    import statistics
    import time as _time

    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(10):
        fn(i)
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / 10, 1e-3)
    batch = max(1, math.ceil(min_batch_ms / est_ms))
    samples, host = [], []
    spent, call = 0.0, 0
    while len(samples) < 5 or spent < rep_ms:
        start.record()
        t0 = _time.perf_counter()
        for _ in range(batch):
            fn(call)
            call += 1
        host.append((_time.perf_counter() - t0) / batch)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        samples.append(ms / batch)
        spent += ms
        if len(samples) >= 1000:
            break
    return Timing(gpu_us=1e3 * statistics.median(samples), host_us=1e6 * statistics.fmean(host), calls=call)


def measure_copy_bandwidth(torch, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s: (bytes read + bytes written) / median time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = time_calls(torch, lambda i: dst.copy_(src), warmup=10, rep_ms=300.0)
    gbps = 2 * src.numel() * 4 / (t.gpu_us * 1e-6) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbps


def make_sdpa(torch, F):
    """The SDPA baseline for q [B, Hq, D], k/v [B, N, Hkv, D]; returns (fn, mode)."""
    import inspect

    has_gqa = "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters

    def sdpa_gqa(q, k, v):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    def sdpa_repeat(q, k, v):
        g = q.shape[1] // k.shape[2]
        kk = k.transpose(1, 2).repeat_interleave(g, dim=1)
        vv = v.transpose(1, 2).repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv)

    if has_gqa:
        return sdpa_gqa, "enable_gqa=True on transposed views [B,Hkv,N,D]"
    return sdpa_repeat, "K/V heads repeated (repeat_interleave inside the timed call)"


def render(rows: list[dict], meta: dict) -> None:
    headers = ["B", "N", "KV GiB", "config", "triton us", "host us", "GB/s", "% copy", "model us", "SDPA us", "SDPA GB/s", "% copy", "speedup"]

    def fmt(r):
        def f(x, spec):
            return "-" if x is None else format(x, spec)

        return [
            str(r["batch"]), str(r["kv_len"]), f(r["kv_bytes"] / 2**30, ".2f"), r["config"],
            f(r["triton_us"], ".1f"), f(r["triton_host_us"], ".1f"), f(r["triton_gbps"], ".0f"), f(r["triton_frac_copy"] and 100 * r["triton_frac_copy"], ".1f"),
            f(r["model_us"], ".1f"), f(r["sdpa_us"], ".1f"), f(r["sdpa_gbps"], ".0f"),
            f(r["sdpa_frac_copy"] and 100 * r["sdpa_frac_copy"], ".1f"), f(r["speedup_vs_sdpa"], ".2f"),
        ]

    title = f"decode attention on {meta['device']} (copy bandwidth {meta['copy_bandwidth_gbps']:.0f} GB/s)"
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*fmt(r))
        # Not a terminal (piped to a log): wide enough that no column is cut.
        Console(width=None if sys.stdout.isatty() else 200).print(table)
    except ImportError:
        print(title)
        print(" | ".join(headers))
        for r in rows:
            print(" | ".join(fmt(r)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, lengths {QUICK_LENS}")
    ap.add_argument("--batches", type=_ints, default=None, help="comma list, e.g. 1,4,16")
    ap.add_argument("--lens", type=_ints, default=None, help="comma list of KV lengths, e.g. 4k,64k,1m")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--config", type=str, default=None, help='DecodeConfig as JSON, e.g. \'{"block_n": 64, "num_splits": 32}\'')
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="GPU time spent timing each point (ms)")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of each copy buffer for the bandwidth probe")
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("bench_kernel: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA or ROCm GPU visible: this benchmark times GPU kernels and has nothing to do here.", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton

    from tree_attn.kernels.config import DecodeConfig, resolve_config
    from tree_attn.kernels.perf_model import DeviceSpec, predict_time_us
    from tree_attn.kernels.reference import decode_attention_torch
    from tree_attn.kernels.shapes import DecodeShape
    from tree_attn.kernels.triton_launch import decode_attention_triton

    dtype = torch.bfloat16
    elem = 2
    batches = args.batches or (QUICK_BATCHES if args.quick else FULL_BATCHES)
    lens = args.lens or (QUICK_LENS if args.quick else FULL_LENS)
    user_cfg = DecodeConfig.from_dict(json.loads(args.config)) if args.config else None

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    spec = DeviceSpec.from_torch_device(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or spec.l2_bytes or 64 * 2**20)

    free, total = torch.cuda.mem_get_info()
    copy_bytes = int(min(args.copy_gib * 2**30, free / 4))
    _log(f"measuring device-to-device copy bandwidth with 2 x {copy_bytes / 2**30:.2f} GiB ...")
    copy_gbps = measure_copy_bandwidth(torch, copy_bytes)
    _log(f"copy bandwidth: {copy_gbps:.0f} GB/s (datasheet {spec.mem_bandwidth_gbps:.0f} GB/s for {spec.name})")
    measured_spec = spec.with_measured_bandwidth(copy_gbps)

    sdpa, sdpa_mode = make_sdpa(torch, F)

    # Correctness first, at one modest size with ragged lengths.
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, HQ, HEAD_DIM, device=dev, dtype=dtype, generator=g)
    k = torch.randn(2, 8192 + 77, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    lens_t = torch.tensor([8192 + 77, 5000], device=dev)
    out, lse = decode_attention_triton(q, k, v, seq_lens=lens_t, config=user_cfg)
    ref_out, ref_lse = decode_attention_torch(q, k, v, seq_lens=lens_t)
    err_out = (out.float() - ref_out.float()).abs().max().item()
    err_lse = (lse - ref_lse).abs().max().item()
    if not (err_out <= 2e-2 and err_lse <= 2e-3):
        print(f"bench_kernel: kernel disagrees with the torch reference (max |out| err {err_out:.3g}, |lse| err {err_lse:.3g}); not timing it.", file=sys.stderr)
        return 1
    if not args.no_sdpa:
        s_out = sdpa(q[:1], k[:1], v[:1]).squeeze(2)
        sdpa_err = (s_out.float() - ref_out[:1].float()).abs().max().item()
    else:
        sdpa_err = None
    _log(f"check vs torch reference: max |out| err {err_out:.2e}, max |lse| err {err_lse:.2e}; SDPA vs reference {sdpa_err}")
    del q, k, v, out, lse, ref_out, ref_lse
    torch.cuda.empty_cache()

    rows = []
    for b in batches:
        for n in lens:
            kv_bytes = 2 * b * n * HKV * HEAD_DIM * elem
            free, _ = torch.cuda.mem_get_info()
            # Enough buffers that together they are >= 3x L2, but within ~70% of free memory.
            n_buf = max(1, min(8, math.ceil(3 * l2 / kv_bytes)))
            while n_buf > 1 and n_buf * kv_bytes > 0.7 * free:
                n_buf -= 1
            if kv_bytes > 0.7 * free:
                _log(f"skip B={b} N={n}: K+V need {kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                continue
            bufs = []
            for i in range(n_buf):
                gi = torch.Generator(device="cuda").manual_seed(i + 1)
                bufs.append(
                    (
                        torch.randn(b, HQ, HEAD_DIM, device=dev, dtype=dtype, generator=gi),
                        torch.randn(b, n, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=gi),
                        torch.randn(b, n, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=gi),
                    )
                )
            shape = DecodeShape(b, HQ, HKV, HEAD_DIM, n)
            cfg = resolve_config(user_cfg, shape, dtype, spec)

            def run_triton(i):
                qq, kk, vv = bufs[i % n_buf]
                decode_attention_triton(qq, kk, vv, config=cfg)

            tt = time_calls(torch, run_triton, rep_ms=args.rep_ms)
            t_ms = tt.gpu_us / 1e3
            row = {
                "batch": b,
                "kv_len": n,
                "kv_bytes": kv_bytes,
                "buffers": n_buf,
                "config": cfg.describe(),
                "config_dict": cfg.to_dict(),
                "triton_us": tt.gpu_us,
                "triton_host_us": tt.host_us,
                "host_bound": tt.host_us >= 0.9 * tt.gpu_us,
                "triton_gbps": kv_bytes / (t_ms * 1e-3) / 1e9,
                "model_us": predict_time_us(cfg, shape, dtype, measured_spec),
                "sdpa_us": None,
                "sdpa_gbps": None,
                "sdpa_error": None,
            }
            row["triton_frac_copy"] = row["triton_gbps"] / copy_gbps
            if not args.no_sdpa:
                try:

                    def run_sdpa(i):
                        qq, kk, vv = bufs[i % n_buf]
                        sdpa(qq, kk, vv)

                    ts = time_calls(torch, run_sdpa, rep_ms=args.rep_ms)
                    row["sdpa_us"] = ts.gpu_us
                    row["sdpa_host_us"] = ts.host_us
                    row["sdpa_gbps"] = kv_bytes / (ts.gpu_us * 1e-6) / 1e9
                except torch.cuda.OutOfMemoryError as exc:
                    row["sdpa_error"] = f"out of memory: {str(exc).splitlines()[0]}"
                except RuntimeError as exc:
                    row["sdpa_error"] = str(exc).splitlines()[0]
            row["sdpa_frac_copy"] = row["sdpa_gbps"] / copy_gbps if row["sdpa_gbps"] else None
            row["speedup_vs_sdpa"] = row["sdpa_us"] / row["triton_us"] if row["sdpa_us"] else None
            rows.append(row)
            _log(
                f"B={b} N={n}: triton {row['triton_us']:.1f} us {row['triton_gbps']:.0f} GB/s "
                f"({100 * row['triton_frac_copy']:.1f}% of copy); SDPA "
                + (f"{row['sdpa_us']:.1f} us" if row["sdpa_us"] else str(row["sdpa_error"]))
            )
            del bufs
            torch.cuda.empty_cache()

    long_rows = [r for r in rows if r["kv_len"] >= GOAL_MIN_LEN]
    goal_bw = [r for r in long_rows if r["triton_frac_copy"] < GOAL_FRACTION]
    b1_rows = [r for r in long_rows if r["batch"] == 1]
    # A point where SDPA failed (e.g. out of memory) has no speedup: it counts as not shown.
    goal_speed = [r for r in b1_rows if r["speedup_vs_sdpa"] is None or r["speedup_vs_sdpa"] < GOAL_SPEEDUP]
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "device_spec": spec.name,
        "datasheet_bandwidth_gbps": spec.mem_bandwidth_gbps,
        "copy_bandwidth_gbps": copy_gbps,
        "copy_buffer_bytes": copy_bytes,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "timing": "median per-call time over batches of back-to-back calls (CUDA events), inputs rotated over buffers >= 3x L2, no flush",
        "sdpa_mode": sdpa_mode,
        "check": {"max_abs_out_err": err_out, "max_abs_lse_err": err_lse, "sdpa_max_abs_out_err": sdpa_err},
        "goals": {
            "bandwidth_fraction": GOAL_FRACTION,
            "speedup_vs_sdpa_batch1": GOAL_SPEEDUP,
            "min_kv_len": GOAL_MIN_LEN,
            "bandwidth_goal_met": bool(long_rows) and not goal_bw,
            "speedup_goal_met": bool(b1_rows) and not goal_speed,
        },
    }
    render(rows, meta)
    print(
        f"goal >= {GOAL_FRACTION:.0%} of copy bandwidth for N >= {GOAL_MIN_LEN}: "
        + ("met" if meta["goals"]["bandwidth_goal_met"] else f"NOT met at {[(r['batch'], r['kv_len']) for r in goal_bw]}")
    )
    print(
        f"goal >= {GOAL_SPEEDUP:.0f}x SDPA at batch 1, N >= {GOAL_MIN_LEN}: "
        + ("met" if meta["goals"]["speedup_goal_met"] else f"NOT met at {[(r['batch'], r['kv_len']) for r in goal_speed]}")
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        tmp.replace(args.out)
        _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
