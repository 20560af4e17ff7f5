"""Query rows per KV head on CPU: where the fused C kernel beats the torch ops (MKL's products).

A call with Sq query tokens and G query heads per KV head has Sq x G query rows per KV head. The
C kernel (``tree_attn/kernels/cpu_decode.c``) computes dot products per row; MKL's GEMM amortises
its loads over many rows. ``tree_attn.kernels.cpu_decode.NATIVE_MAX_QUERY_ROWS`` is the largest
row count the C kernel takes by default; this script measures the two paths side by side, so that
the constant can be set from numbers of the machine at hand.

For each shape (``mha``: 8 x 128, G = 1; ``gqa``: 32/8 x 128, G = 4) and each ``--sq``, B = 1,
fp32, causal, one thread: ``decode_attention_cpu(..., native=True)`` (the C kernel) and
``native=False`` (the torch ops) on the same tensors, in interleaved rounds (every round times both,
so drifting load hits them alike); the best of ``--repeats`` rounds after one warm-up call. Both
results are checked against float64 first, on the first ``--check-tokens`` tokens (max abs error of
out and lse: ``C err``, ``t err``). Nothing here asserts a time.

    python benchmarks/bench_cpu_rows.py                              # 16,384 tokens, Sq 1..16
    python benchmarks/bench_cpu_rows.py --tokens 65536 --sq 4,8,16 --json rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.kernels.cpu_decode import NATIVE_MAX_QUERY_ROWS, decode_attention_cpu
from tree_attn.kernels.cpu_native import native_status
from tree_attn.kernels.reference import decode_attention_float64

SHAPES = {"mha": (8, 8, 128), "gqa": (32, 8, 128)}  # q heads, KV heads, head size


def _time(q, k, v, native: bool) -> float:
    t0 = time.perf_counter()
    decode_attention_cpu(q, k, v, causal=True, native=native)
    return (time.perf_counter() - t0) * 1e3


def _error(q, k, v, native: bool) -> float:
    out, lse = decode_attention_cpu(q, k, v, causal=True, native=native)
    ref_out, ref_lse = decode_attention_float64(q, k, v, causal=True)
    finite = torch.isfinite(ref_lse)
    return max((out.double() - ref_out).abs().max().item(), (lse.double() - ref_lse)[finite].abs().max().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="KV tokens of the row")
    ap.add_argument("--shapes", default="mha,gqa", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--sq", default="1,2,4,8,16", help="query tokens per call, comma-separated")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds; the best is reported")
    ap.add_argument("--check-tokens", type=int, default=1024, help="tokens of the float64 check")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    try:
        sqs = sorted({int(x) for x in args.sq.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--sq takes integers, got {args.sq!r}")
    if not sqs or min(sqs) < 1 or args.tokens < max(sqs) or args.repeats < 1:
        ap.error("--sq values must be >= 1 and <= --tokens, and --repeats >= 1")
    exit_if_unwritable(ap, {"--json": args.json})
    status = native_status()
    if not status.available:
        print(f"the C kernel is not available here: {status.describe()}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; load average before {os.getloadavg()[0]:.2f}")
    print(f"{status.describe()}; by default up to NATIVE_MAX_QUERY_ROWS = {NATIVE_MAX_QUERY_ROWS} rows")
    print(f"{'shape':5} {'tokens':>7} {'sq':>3} {'rows':>5} {'C ms':>9} {'torch ms':>9} {'torch/C':>8} {'default':>8}"
          f" {'C err':>8} {'t err':>8}")
    results = []
    for name in shapes:
        hq, hkv, d = SHAPES[name]
        check = min(args.check_tokens, args.tokens)
        for sq in sqs:
            q = torch.randn(1, sq, hq, d, generator=gen)
            k = torch.randn(1, args.tokens, hkv, d, generator=gen)
            v = torch.randn(1, args.tokens, hkv, d, generator=gen)
            small = (q, k[:, :check], v[:, :check])
            errors = {"c": _error(*small, True), "torch": _error(*small, False)}
            for native in (True, False):
                _time(q, k, v, native)  # warm-up
            best = {True: float("inf"), False: float("inf")}
            for _ in range(args.repeats):
                for native in (True, False):
                    best[native] = min(best[native], _time(q, k, v, native))
            rows = sq * hq // hkv
            default = "C" if rows <= NATIVE_MAX_QUERY_ROWS else "torch"
            print(f"{name:5} {args.tokens:>7} {sq:>3} {rows:>5} {best[True]:>9.2f} {best[False]:>9.2f} "
                  f"{best[False] / best[True]:>8.2f} {default:>8} {errors['c']:>8.1e} {errors['torch']:>8.1e}",
                  flush=True)
            results.append({"shape": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "tokens": args.tokens,
                            "sq": sq, "rows": rows, "c_ms": best[True], "torch_ms": best[False],
                            "default": default, "max_error": errors})
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if args.json:
        meta = {"machine": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                "kernel": status.describe(), "native_max_query_rows": NATIVE_MAX_QUERY_ROWS,
                "repeats": args.repeats, "threads": 1, "dtype": "float32", "causal": True}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
