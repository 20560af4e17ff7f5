#!/usr/bin/env python
"""Host time of tree-attn's own Python per eager decode call, measured on any machine (no GPU needed).

What an eager ``decode_attention`` call costs the host is tree-attn's Python (checks, config,
buffers, arguments) plus Triton's launch (``JITFunction.run``: argument specialisation, the kernel
cache lookup, the driver call). The second needs a GPU; the first does not. Here the two Triton
kernels are replaced by launchers that do nothing, on CPU tensors, so what is timed is tree-attn's
part alone:

- ``resolved per call``: ``decode_attention_triton``, which resolves everything afresh each call
  (the behaviour of every call before plans were prepared once);
- ``prepared (public API)``: ``decode_attention(..., impl="triton")``, a cache lookup by signature
  then the prepared launch;
- ``prepared object``: calling a ``PreparedDecode`` directly (what a ``DecodeStep`` replays).

Also the eager ``tree_decode`` merge path on one gloo rank with the torch kernel (tiny shapes, so
the kernel's own time is small): the host overhead of the collective wrapper.

    python benchmarks/bench_host.py [--calls 20000] [--out benchmarks/out/bench_host.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# The launcher accepts CPU tensors only under Triton's interpreter; nothing is interpreted here
# (the kernels are stubbed), but the flag must be set before triton is imported.
os.environ["TRITON_INTERPRET"] = "1"


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        return None


def _per_call_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(min(200, calls)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per sample (5 samples, median)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tree_attn.files import atomic_write_text, exit_if_unwritable

    exit_if_unwritable(ap, {"--out": args.out})

    import torch

    torch.set_num_threads(1)
    from tree_attn import decode_attention
    from tree_attn.kernels import triton_decode
    from tree_attn.kernels.config import DecodeConfig
    from tree_attn.kernels.prepared import PreparedDecode
    from tree_attn.kernels.triton_launch import decode_attention_triton

    triton_decode.split_kv_stage1_kernel = _NoLaunch()
    triton_decode.split_kv_stage2_kernel = _NoLaunch()

    rows = []
    for b, n, splits in ((1, 4096, 16), (1, 65536, 64), (16, 65536, 1)):
        q = torch.randn(b, 32, 128, dtype=torch.bfloat16)
        k = torch.randn(b, n, 8, 128, dtype=torch.bfloat16)
        v = torch.randn(b, n, 8, 128, dtype=torch.bfloat16)
        cfg = DecodeConfig(block_n=64, num_warps=4, num_stages=2, num_splits=splits)
        prepared = PreparedDecode(q, k, v, impl="triton", config=cfg)
        out, lse = prepared.new_outputs()
        row = {
            "batch": b, "kv_len": n, "splits": splits,
            # Each lambda is timed right here; the defaults bind this shape's tensors all the same.
            "resolved_per_call_us": _per_call_us(
                lambda q=q, k=k, v=v, cfg=cfg: decode_attention_triton(q, k, v, config=cfg), args.calls),
            "public_api_us": _per_call_us(
                lambda q=q, k=k, v=v, cfg=cfg: decode_attention(q, k, v, impl="triton", config=cfg), args.calls),
            "prepared_object_us": _per_call_us(
                lambda p=prepared, q=q, k=k, v=v, out=out, lse=lse: p(q, k, v, None, out, lse), args.calls),
        }
        rows.append(row)
        print(f"B={b} N={n} splits={splits}: resolved per call {row['resolved_per_call_us']:.1f} us, "
              f"public API {row['public_api_us']:.1f} us, prepared object {row['prepared_object_us']:.1f} us",
              file=sys.stderr)

    # tree_decode on one gloo rank, torch kernel, tiny shapes: the collective wrapper's host cost.
    import torch.distributed as dist

    from tree_attn import tree_decode

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            q = torch.randn(1, 8, 64)
            k = torch.randn(1, 16, 2, 64)
            local = _per_call_us(lambda: decode_attention(q, k, k), args.calls // 10)
            tree = _per_call_us(lambda: tree_decode(q, k, k), args.calls // 10)
        finally:
            dist.destroy_process_group()
    wrapper = {"decode_attention_torch_us": local, "tree_decode_world1_us": tree}

    meta = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "what": "host time per call of tree-attn's Python with Triton's launches stubbed out (Triton's own "
                "JITFunction.run, about half of an eager call on an H100, is not included)",
    }
    print(f"tree-attn's host time per eager call, Triton launches stubbed ({meta['machine']}, Python {meta['python']})")
    print(f"{'B':>3} {'N':>7} {'splits':>6} {'resolved/call us':>17} {'public API us':>14} {'prepared us':>12}")
    for r in rows:
        print(f"{r['batch']:>3} {r['kv_len']:>7} {r['splits']:>6} {r['resolved_per_call_us']:>17.1f} "
              f"{r['public_api_us']:>14.1f} {r['prepared_object_us']:>12.1f}")
    print(f"torch path, tiny shape (B=1, Hq=8, N=16, D=64): decode_attention {local:.1f} us, "
          f"tree_decode on 1 gloo rank {tree:.1f} us")
    if args.out:
        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows, "wrapper": wrapper}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
