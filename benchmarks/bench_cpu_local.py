"""Local decode attention on one CPU core: ours against the read bandwidth and a public peer.

What one CPU rank computes per decode step: attention of one query per head over its KV shard.
This script times, on the same machine and in interleaved rounds (so that drifting load from
other processes hits every column alike):

- ``bw``: one core's read bandwidth, ``torch.sum`` over a float32 tensor of ``--bw-mib`` MiB (far
  larger than the caches);
- ``ours``: ``tree_attn.decode_attention(q, k, v, impl="torch")`` (the CPU path,
  ``tree_attn.kernels.cpu_decode``), k/v ``[1, N, Hkv, D]`` as ``run`` stores shards: the fused
  C kernel (``cpu_native``) when it is built on this machine, which the header line says;
- ``torch-ops``: the same call with the C kernel turned off (``decode_attention_cpu(...,
  native=False)``), the path every machine without a C compiler runs;
- ``prev``: the previous torch path (``reference.decode_attention_chunked``: per-chunk einsum,
  logsumexp and stacked merge), for the record;
- ``peer``: ``tree_attn_decode`` from lucidrains/ring-attention-pytorch (pure torch einsum) when
  ``--peer-path`` points at a checkout of it, run exactly as its CPU path runs on a rank: a
  1-rank gloo process group, ``shard_kv_seq=False`` (the tensors are this rank's shard), k/v in
  its own ``[b, h, n, d]`` layout. Its step is its local attention plus three all-reduces, which on
  one rank are cheap; the script times those three all-reduces alone too (``peer_ar_ms``). The
  peer has no GQA: its einsum pairs query and key heads one to one, so a GQA query
  ``[1, Hq, D]`` is given to it as ``[1, Hkv, G, D]`` (the G query heads of a KV head as its G
  query positions; no mask, so the math is the same).

Each timed call is checked first: max abs error of out and lse against the float64 truth for ours,
of out for the peer (which computes fp16/bf16 inputs in their own dtype, hence its larger errors
there). ``fp8``: the bf16 cache quantized per KV head (``tree_attn.quantize_kv``, float8_e4m3fn
with float32 scales), a bf16 query; the truth is float64 on the dequantized cache, the K+V bytes
1 per element (the peer has no fp8: not run). With both fp8 and bf16 rows the table's last lines
give each fp8 step over the bf16 step of the same shape, from the same run.
Times are medians over ``--repeats`` rounds after ``--warmup``;
"% bw" = the call's K+V bytes / its median time / the median read bandwidth. Single-threaded by
default (``--threads 1``), as a rank gets ``cpu_count // world_size`` threads and the comparison
is per core. Nothing here asserts a time.

    python benchmarks/bench_cpu_local.py                                   # ours, prev, bandwidth
    python benchmarks/bench_cpu_local.py --peer-path ../ring-attention-pytorch --peer-commit <sha>
    python benchmarks/bench_cpu_local.py --quick                           # 16K tokens, fp32 only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run from a checkout without installing: make the repository root importable.
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn import decode_attention
from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.kernels.cpu_decode import decode_attention_cpu
from tree_attn.kernels.cpu_native import native_status
from tree_attn.kernels.reference import decode_attention_chunked, decode_attention_float64

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# (Hq, Hkv, D): MHA 8 x 128; Llama-3.1-8B's attention; a layer of generate's small preset
SHAPES = {"mha": (8, 8, 128), "gqa": (32, 8, 128), "small": (8, 2, 64)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_peer(path: str | None):
    """The peer's ``tree_attn_decode`` and a note, or ``(None, reason)``."""
    if not path:
        return None, "peer not available (no --peer-path)"
    if not Path(path, "ring_attention_pytorch", "tree_attn_decoding.py").is_file():
        return None, f"peer not available: no ring_attention_pytorch/tree_attn_decoding.py under {path}"
    sys.path.insert(0, str(Path(path).resolve()))
    try:
        from ring_attention_pytorch.tree_attn_decoding import tree_attn_decode
    except Exception as exc:  # noqa: BLE001 - missing einops / jaxtyping / beartype, or an incompatible torch
        return None, f"peer not available: import failed ({type(exc).__name__}: {exc})"
    return tree_attn_decode, "ok"


def peer_commit(path: str | None, given: str | None) -> str | None:
    if given or not path:
        return given
    try:
        return subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def one_rank_gloo() -> None:
    """A 1-rank gloo group over loopback, as the peer's tree_attn_decode calls all_reduce."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)


def make_case(hq: int, hkv: int, d: int, n: int, dtype: torch.dtype, seed: int, with_peer: bool):
    """q, k, v, the peer's arguments, and the scales' keywords (fp8: the bf16 cache of the same
    seed quantized, q in bf16)."""
    fp8 = dtype == torch.float8_e4m3fn
    made = torch.bfloat16 if fp8 else dtype
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, d, generator=g).to(made)
    k = torch.randn(1, n, hkv, d, generator=g).to(made)
    v = torch.randn(1, n, hkv, d, generator=g).to(made)
    if fp8:
        from tree_attn import quantize_kv

        k, v, k_scale, v_scale = quantize_kv(k, v)
        return q, k, v, None, {"k_scale": k_scale, "v_scale": v_scale}
    peer_args = None
    if with_peer:
        # The peer's layout: q [b, h, i, d], k/v [b, h, n, d], contiguous.
        peer_args = (
            q.view(1, hkv, hq // hkv, d).contiguous(),
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
        )
    return q, k, v, peer_args, {}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(args, name: str, n: int, dtype_name: str, threads: int, peer, bw_tensor) -> dict:
    hq, hkv, d = SHAPES[name]
    dtype = DTYPES[dtype_name]
    torch.set_num_threads(threads)
    fp8 = dtype == torch.float8_e4m3fn
    q, k, v, peer_args, sc = make_case(hq, hkv, d, n, dtype, seed=n + hq, with_peer=peer is not None and not fp8)
    kv_bytes = 2 * k.numel() * k.element_size()
    row = {
        "shape": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "tokens": n, "dtype": dtype_name,
        "threads": threads, "kv_bytes": kv_bytes,
    }
    # Correctness first (not timed).
    ref_out, ref_lse = decode_attention_float64(q, k, v, **sc)
    out, lse = decode_attention(q, k, v, impl="torch", **sc)
    row["ours_out_err"] = (out.double() - ref_out).abs().max().item()
    row["ours_lse_err"] = (lse.double() - ref_lse).abs().max().item()
    fns = {
        "bw": lambda: bw_tensor.sum(),
        "ours": lambda: decode_attention(q, k, v, impl="torch", **sc),
        "torchops": lambda: decode_attention_cpu(q, k, v, native=False, **sc),
    }
    if not args.no_prev:
        fns["prev"] = lambda: decode_attention_chunked(q, k, v, **sc)
    if peer is not None and not fp8:
        import torch.distributed as dist

        pq, pk, pv = peer_args
        p_out = peer(pq, pk, pv, shard_kv_seq=False)
        row["peer_out_err"] = (p_out.reshape(1, hq, d).double() - ref_out).abs().max().item()
        row["peer_vs_ours_out"] = (p_out.reshape(1, hq, d).double() - out.double()).abs().max().item()
        fns["peer"] = lambda: peer(pq, pk, pv, shard_kv_seq=False)
        # The three all-reduces of the peer's step alone (sizes as in its code: lse max, den, num).
        lse_buf = torch.zeros(1, hkv, hq // hkv, 1)
        num_buf = torch.zeros(1, hkv, hq // hkv, d, dtype=pq.dtype)

        def three_allreduces():
            dist.all_reduce(lse_buf, dist.ReduceOp.MAX)
            dist.all_reduce(lse_buf)
            dist.all_reduce(num_buf)

        fns["peer_ar"] = three_allreduces
    del ref_out, ref_lse
    times = {key: [] for key in fns}
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    for _ in range(args.repeats):
        for key, fn in fns.items():
            times[key].append(timed(fn))
    bw = bw_tensor.numel() * bw_tensor.element_size() / statistics.median(times.pop("bw")) / 1e9
    row["bw_gbs"] = bw
    for key, ts in times.items():
        med = statistics.median(ts)
        row[f"{key}_ms"] = med * 1e3
        row[f"{key}_ms_min"] = min(ts) * 1e3
        if key != "peer_ar":
            row[f"{key}_gbs"] = kv_bytes / med / 1e9
            row[f"{key}_pct_bw"] = 100 * kv_bytes / med / 1e9 / bw
    if "peer_ms" in row:
        row["peer_over_ours"] = row["peer_ms"] / row["ours_ms"]
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'shape':5s} {'tokens':>6s} {'dtype':5s} {'thr':>3s} {'bw GB/s':>7s} {'ours ms':>8s} {'GB/s':>5s} "
        f"{'%bw':>4s} {'t-ops ms':>8s} {'%bw':>4s} {'prev ms':>8s} {'%bw':>4s} {'peer ms':>8s} {'%bw':>4s} "
        f"{'peer/ours':>9s} {'ours err':>8s}"
    )
    print(head)
    for r in rows:
        prev = f"{r['prev_ms']:8.2f} {r['prev_pct_bw']:4.0f}" if "prev_ms" in r else f"{'-':>8s} {'-':>4s}"
        tops = f"{r['torchops_ms']:8.2f} {r['torchops_pct_bw']:4.0f}" if "torchops_ms" in r else f"{'-':>8s} {'-':>4s}"
        peer = (
            f"{r['peer_ms']:8.2f} {r['peer_pct_bw']:4.0f} {r['peer_over_ours']:9.2f}"
            if "peer_ms" in r else f"{'-':>8s} {'-':>4s} {'-':>9s}"
        )
        err = max(r["ours_out_err"], r["ours_lse_err"])
        perr = f"{r['peer_out_err']:8.1e}" if "peer_out_err" in r else f"{'-':>8s}"
        print(
            f"{r['shape']:5s} {r['tokens']:6d} {r['dtype']:5s} {r['threads']:3d} {r['bw_gbs']:7.1f} "
            f"{r['ours_ms']:8.2f} {r['ours_gbs']:5.1f} {r['ours_pct_bw']:4.0f} {tops} {prev} {peer} {err:8.1e} {perr}"
        )
    for line in fp8_ratios(rows):
        print(line)


def fp8_ratios(rows: list[dict]) -> list[str]:
    """Each fp8 row's step over the bf16 row of the same shape, tokens and threads (same run)."""
    bf16 = {(r["shape"], r["tokens"], r["threads"]): r for r in rows if r["dtype"] == "bf16"}
    lines = []
    for r in rows:
        base = bf16.get((r["shape"], r["tokens"], r["threads"]))
        if r["dtype"] != "fp8" or base is None:
            continue
        lines.append(
            f"fp8/bf16 {r['shape']} {r['tokens']} thr {r['threads']}: ours {r['ours_ms'] / base['ours_ms']:.2f}x "
            f"({r['ours_ms']:.2f} vs {base['ours_ms']:.2f} ms; fp8 at {r['ours_pct_bw']:.0f}% of read bandwidth on "
            f"its {r['kv_bytes'] / 2**20:.0f} MiB, bf16 at {base['ours_pct_bw']:.0f}%), torch ops "
            f"{r['torchops_ms'] / base['torchops_ms']:.2f}x"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,65536", help="KV tokens per rank, comma-separated")
    ap.add_argument("--shapes", default="mha,gqa", help="mha (8 x 128), gqa (32/8 x 128), small (8/2 x 64)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="fp32, bf16, fp16, fp8 (float8_e4m3fn, from bf16)")
    ap.add_argument("--threads", default="1", help="intra-op threads, comma-separated (e.g. 1,2)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bw-mib", type=int, default=1024, help="size of the bandwidth-probe tensor")
    ap.add_argument("--peer-path", help="checkout of lucidrains/ring-attention-pytorch (not copied, only imported)")
    ap.add_argument("--peer-commit", help="the peer's commit, recorded in the JSON (default: git rev-parse)")
    ap.add_argument("--no-prev", action="store_true", help="skip the previous torch path")
    ap.add_argument("--quick", action="store_true", help="16K tokens, fp32, both shapes, 5 repeats")
    ap.add_argument("--json", default="benchmarks/out/bench_cpu_local.json")
    ap.add_argument("--table-from", help="reprint the table of an earlier run's JSON instead of measuring")
    args = ap.parse_args()
    if args.table_from:
        data = json.loads(Path(args.table_from).read_text())
        print(f"machine: {data['machine']}")
        print(f"ours: {data.get('ours', 'torch ops (before the C kernel)')}")
        print_table(data["rows"])
        return 0
    exit_if_unwritable(ap, {"--json": args.json})
    if args.quick:
        args.tokens, args.dtypes, args.repeats = "16384", "fp32", 5

    peer, peer_note = load_peer(args.peer_path)
    if peer is not None:
        one_rank_gloo()
    print(peer_note if peer is None else f"peer: {args.peer_path}", file=sys.stderr)
    machine = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "load_before": os.getloadavg(),
    }
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}; "
          f"load average {machine['load_before'][0]:.2f}", file=sys.stderr)
    ours = native_status().describe()
    print(f"ours: {ours}", file=sys.stderr)
    bw_tensor = torch.randn(args.bw_mib * (1 << 20) // 4)
    rows = []
    for threads in [int(x) for x in args.threads.split(",")]:
        for n in [int(x) for x in args.tokens.split(",")]:
            for dtype_name in args.dtypes.split(","):
                for name in args.shapes.split(","):
                    print(f"{name} {n} {dtype_name} threads={threads} ...", file=sys.stderr, flush=True)
                    rows.append(run_case(args, name, n, dtype_name, threads, peer, bw_tensor))
    machine["load_after"] = os.getloadavg()
    result = {
        "machine": f"{machine['cpu']}, {machine['cores']} cores",
        "machine_info": machine,
        "ours": ours,
        "peer": {"repo": "lucidrains/ring-attention-pytorch", "commit": peer_commit(args.peer_path, args.peer_commit),
                 "status": peer_note} if args.peer_path else {"status": peer_note},
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    print(f"machine: {result['machine']}; load average before {machine['load_before'][0]:.2f}, "
          f"after {machine['load_after'][0]:.2f}")
    print(f"ours: {ours}")
    print_table(rows)
    if peer is None:
        print(peer_note)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
