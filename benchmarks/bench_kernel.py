#!/usr/bin/env python
"""Decode-attention kernel benchmark against torch SDPA (GPU only): device time, eager time, host time.

Shape: Llama-3.1-8B attention (32 query heads, 8 KV heads, head dim 128, bf16), one new query per
row, batch 1-16, KV length 1K-1M per GPU (combinations that do not fit in memory are skipped).

For each point and for both ours (``tree_attn.decode_attention``, the public eager call) and SDPA:
- graph us: the device time of one call: a CUDA graph of back-to-back calls replayed between CUDA
  events (``tree_attn.timing``), median per call; the GPU never waits for the host;
- eager us: the same calls issued eagerly, between events: what a caller without graphs gets;
- host us: the host's time to issue one eager call (Python, checks, launches).
Consecutive calls read different input buffers, together at least 3x the L2 cache, so L2 never
serves the KV cache. Bandwidth = K+V bytes / graph time, and its fraction of this card's measured
device-to-device copy bandwidth (bytes read + written). SDPA gets q as ``[B, Hq, 1, D]`` and K/V as
transposed views ``[B, Hkv, N, D]`` of the ``[B, N, Hkv, D]`` cache with ``enable_gqa=True`` (on a
torch without it, K/V heads repeated inside the call: the table says which).

fp8 rows (``--kv-dtypes bf16,fp8``, the default): the same shapes over a ``float8_e4m3fn`` cache
with float32 scales per KV head and a bf16 query, beside the bf16 rows. Their bandwidth counts the
fp8 bytes (1 per element), and ``fp8/bf16`` is their graph time over the bf16 row's. No SDPA
baseline (it takes no fp8 cache). They run through ``decode_attention(..., k_scale=, v_scale=)``
when the library takes those keywords, else through the launcher that its prepared path runs
(``TritonDecodeLaunch``, same kernels; only the host time differs): ``meta.fp8_path`` says which.
Before timing, the fp8 kernel is checked against float64 on the dequantized cache.
``--fp8-configs`` adds fp8 rows at each point with other configs (e.g. the config the default
replaced), on the same buffers, each checked the same way first; the goals judge the default rows.

Goals reported against (never asserted): eager host time <= 20 us per call at batch 1; eager within
1.15x of graph for N >= 16K; device time <= SDPA's at every shape; >= 90% of copy bandwidth for
N >= 64K (bf16); fp8: graph time <= 0.55x bf16's and >= 85% of copy bandwidth on fp8 bytes for
N >= 64K.

Usage:
    python benchmarks/bench_kernel.py [--quick] [--out results.json] [--batches 1,4] [--lens 1k,64k]
                                      [--kv-dtypes bf16,fp8] [--fp8-configs '[{"block_n": 128, "num_warps": 8}]']
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import platform
import sys
from pathlib import Path

# Run from a checkout without installing: make the repository root importable.
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

HQ, HKV, HEAD_DIM = 32, 8, 128
FULL_BATCHES = [1, 2, 4, 8, 16]
FULL_LENS = [1024, 4096, 16384, 65536, 262144, 1048576]
QUICK_BATCHES = [1, 8]
QUICK_LENS = [1024, 4096, 65536, 262144]
GOAL_FRACTION = 0.90  # of copy bandwidth, N >= GOAL_MIN_LEN
GOAL_MIN_LEN = 65536
GOAL_HOST_US = 20.0  # eager host time per call at batch 1
GOAL_EAGER_OVER_GRAPH = 1.15  # for N >= GOAL_EAGER_MIN_LEN
GOAL_EAGER_MIN_LEN = 16384
GOAL_FP8_OVER_BF16 = 0.55  # fp8 graph time over bf16's, N >= GOAL_MIN_LEN
GOAL_FP8_FRACTION = 0.85  # of copy bandwidth on fp8 bytes, N >= GOAL_MIN_LEN
KV_DTYPES = {"bf16": ("bfloat16", 2), "fp8": ("float8_e4m3fn", 1)}


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


def make_sdpa(torch, F):
    """The SDPA baseline for q [B, Hq, D], k/v [B, N, Hkv, D]; returns (fn, mode).

    Whether this torch's SDPA takes ``enable_gqa`` is found by calling it (``inspect.signature``
    fails on the builtin in torch 2.11: "no signature found for builtin").
    """
    probe = torch.zeros(1, 2, 1, 16, device="cuda", dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(probe, probe[:, :1], probe[:, :1], enable_gqa=True)
        has_gqa = True
    except TypeError:
        has_gqa = False

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


def random_fp8(torch, shape, device, generator):
    """A ``float8_e4m3fn`` tensor of random finite values: bit patterns drawn uniformly, 0x7f / 0xff
    (NaN) and 0xfe skipped, so magnitudes spread over the format's whole range (2^-9 to 448)."""
    r = torch.randint(0, 253, shape, dtype=torch.uint8, device=device, generator=generator)
    r += (r >= 0x7F).to(torch.uint8)  # 0..0x7e, 0x80..0xfd
    return r.view(torch.float8_e4m3fn)


def fp8_calls(torch, decode_attention, bufs, config, seq_lens=None):
    """One callable per input set ``(q, k, v, k_scale, v_scale)`` over an fp8 cache, each returning
    ``(out, lse)``, and the path they take: the public call when it takes fp8 scales, else the
    launcher its prepared path runs."""
    if "k_scale" in inspect.signature(decode_attention).parameters:
        return [functools.partial(decode_attention, q, k, v, seq_lens=seq_lens, config=config, k_scale=ks, v_scale=vs)
                for q, k, v, ks, vs in bufs], "decode_attention(..., k_scale=, v_scale=)"
    from tree_attn.kernels.triton_launch import TritonDecodeLaunch

    q, k, v, ks, vs = bufs[0]
    lens = None if seq_lens is None else seq_lens.to(torch.int32)
    launch = TritonDecodeLaunch(q, k, v, lens, config=config, k_scale=ks, v_scale=vs)

    def one(q, k, v, ks, vs):
        out, lse = launch.new_outputs()

        def call():
            launch(q, k, v, lens, out, lse, k_scale=ks, v_scale=vs)
            return out, lse

        return call

    return [one(*b) for b in bufs], "TritonDecodeLaunch (the launches of decode_attention's prepared path)"


def float64_attention(torch, q, k, v, lens):
    """float64 attention of ``q [B, Hq, D]`` over ``k, v [B, N, Hkv, D]`` (float64, CPU), the first
    ``lens[b]`` keys of row b: ``out [B, Hq, D]``, ``lse [B, Hq]``."""
    b, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    s = torch.einsum("bhgd,bnhd->bhgn", q.double().view(b, hkv, hq // hkv, d) * d**-0.5, k)
    s = s.masked_fill(~(torch.arange(n)[None, :] < lens[:, None])[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhd->bhgd", torch.softmax(s, -1), v)
    return out.reshape(b, hq, d), torch.logsumexp(s, -1).reshape(b, hq)


def render(rows: list[dict], meta: dict) -> None:
    headers = ["B", "N", "KV", "KV GiB", "config", "graph us", "eager us", "host us", "GB/s", "% copy",
               "fp8/bf16", "SDPA graph", "SDPA eager", "SDPA host", "ours/SDPA dev", "eager/graph"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    def fmt(r):
        return [
            str(r["batch"]), str(r["kv_len"]), r["kv_dtype"], f(r["kv_bytes"] / 2**30, ".2f"), r["config"],
            f(r["graph_us"], ".1f") + ("" if r.get("graph_method") in (None, "cuda-graph") else " (eager)"),
            f(r["eager_us"], ".1f"), f(r["host_us"], ".1f"), f(r["gbps"], ".0f"),
            f(100 * r["frac_copy"], ".1f"), f(r.get("fp8_over_bf16"), ".2f"),
            # an SDPA whose capture failed was timed eagerly (events around back-to-back calls): marked
            f(r["sdpa_graph_us"], ".1f") + ("" if r.get("sdpa_graph_method") in (None, "cuda-graph") else " (eager)"),
            f(r["sdpa_eager_us"], ".1f"),
            f(r["sdpa_host_us"], ".1f"), f(r["device_vs_sdpa"], ".2f"), f(r["eager_over_graph"], ".2f"),
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
        Console(width=None if sys.stdout.isatty() else 220).print(table)
    except ImportError:
        print(title)
        print(" | ".join(headers))
        for r in rows:
            print(" | ".join(fmt(r)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, lengths {QUICK_LENS}")
    ap.add_argument("--batches", type=_ints, default=None, help="comma list, e.g. 1,4,16")
    ap.add_argument("--lens", type=_ints, default=None, help="comma list of KV lengths, e.g. 1k,64k,1m")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--config", type=str, default=None,
                    help='DecodeConfig as JSON, e.g. \'{"block_n": 64, "num_splits": 32}\'')
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    ap.add_argument("--repeats", type=int, default=20, help="timed samples per point (median reported)")
    ap.add_argument("--kv-dtypes", type=str, default="bf16,fp8",
                    help="cache dtypes timed at each point, comma list of bf16, fp8 (default both)")
    ap.add_argument("--fp8-configs", type=str, default="[]",
                    help="more fp8 rows at each point, one per config: a JSON list of DecodeConfig dicts, e.g. "
                         '\'[{"block_n": 64, "num_stages": 2}, {"block_n": 128, "num_warps": 8}]\' (num_splits: the '
                         "heuristic's unless given); checked against float64 like the default, not judged by the goals")
    args = ap.parse_args(argv)
    from tree_attn.files import exit_if_unwritable  # no torch at import

    exit_if_unwritable(ap, {"--out": args.out})  # before the GPU check: a path is refused on any machine
    kv_dtypes = [x.strip() for x in args.kv_dtypes.split(",") if x.strip()]
    if not kv_dtypes or any(x not in KV_DTYPES for x in kv_dtypes):
        ap.error(f"--kv-dtypes: a comma list of {', '.join(KV_DTYPES)}; got {args.kv_dtypes!r}")
    from tree_attn.errors import ConfigError
    from tree_attn.kernels.config import DecodeConfig  # no torch at import

    try:  # checked before anything else, so that a typo fails here and not after the GPU warm-up
        extra = json.loads(args.fp8_configs)
        if not isinstance(extra, list):
            raise ConfigError("a JSON list of DecodeConfig dicts is needed")
        fp8_extra = [DecodeConfig.from_dict(c) for c in extra] if "fp8" in kv_dtypes else []
    except (ValueError, ConfigError) as exc:
        ap.error(f"--fp8-configs: {exc}")

    try:
        import torch
    except ImportError:
        print("bench_kernel: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA or ROCm GPU visible: this benchmark times GPU kernels and has nothing to do here.",
              file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton

    from tree_attn import decode_attention
    from tree_attn.cost.devices import DeviceSpec
    from tree_attn.cost.kernel import predict_time_us
    from tree_attn.kernels.config import resolve_config
    from tree_attn.kernels.reference import decode_attention_float64
    from tree_attn.kernels.shapes import DecodeShape
    from tree_attn.timing import measure_copy_bandwidth, rotation_count, time_calls

    dtype = torch.bfloat16  # the query's, and the bf16 rows' cache
    batches = args.batches or (QUICK_BATCHES if args.quick else FULL_BATCHES)
    lens = args.lens or (QUICK_LENS if args.quick else FULL_LENS)
    user_cfg = DecodeConfig.from_dict(json.loads(args.config)) if args.config else None

    dev = torch.device("cuda", torch.cuda.current_device())
    spec = DeviceSpec.from_torch_device(dev)
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or spec.l2_bytes or 64 * 2**20)

    _log("measuring device-to-device copy bandwidth ...")
    copy_gbps = measure_copy_bandwidth(dev)
    _log(f"copy bandwidth: {copy_gbps:.0f} GB/s (datasheet {spec.mem_bandwidth_gbps:.0f} GB/s for {spec.name})")
    measured_spec = spec.with_measured_bandwidth(copy_gbps)
    sdpa, sdpa_mode = make_sdpa(torch, F)

    # Correctness first, at one modest size with ragged lengths, against float64.
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, HQ, HEAD_DIM, device=dev, dtype=dtype, generator=g)
    k = torch.randn(2, 8192 + 77, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    lens_t = torch.tensor([8192 + 77, 5000], device=dev)
    out, lse = decode_attention(q, k, v, seq_lens=lens_t, config=user_cfg)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens_t)
    err_out = (out.cpu().double() - ref_out).abs().max().item()
    err_lse = (lse.cpu().double() - ref_lse).abs().max().item()
    if not (err_out <= 2e-2 and err_lse <= 2e-3):
        print(f"bench_kernel: kernel disagrees with float64 (max |out| err {err_out:.3g}, |lse| err {err_lse:.3g}); "
              "not timing it.", file=sys.stderr)
        return 1
    sdpa_err = None
    if not args.no_sdpa:
        s_out = sdpa(q[:1], k[:1, :5000], v[:1, :5000]).squeeze(2)
        r_out, _ = decode_attention_float64(q[:1], k[:1, :5000], v[:1, :5000])
        sdpa_err = (s_out.cpu().double() - r_out).abs().max().item()
    _log(f"check vs float64: max |out| err {err_out:.2e}, max |lse| err {err_lse:.2e}; SDPA {sdpa_err}")
    fp8_check = fp8_path = None
    fp8_checks: list[dict] = []
    if "fp8" in kv_dtypes:
        # fp8: against float64 on the dequantized cache (the stored values times their head's scale).
        k8, v8 = random_fp8(torch, k.shape, dev, g), random_fp8(torch, v.shape, dev, g)
        ks = torch.rand(HKV, device=dev, generator=g) / 448 + 1 / 896  # per KV head, |k| <= ~1.4
        vs = torch.rand(HKV, device=dev, generator=g) / 448 + 1 / 896
        k64 = (k8.double() * ks.double()[:, None]).cpu()
        v64 = (v8.double() * vs.double()[:, None]).cpu()
        ref8_out, ref8_lse = float64_attention(torch, q.cpu(), k64, v64, lens_t.cpu())
        for check_cfg in [user_cfg, *fp8_extra]:  # every config timed below
            calls, fp8_path = fp8_calls(torch, decode_attention, [(q, k8, v8, ks, vs)], check_cfg, seq_lens=lens_t)
            out8, lse8 = calls[0]()
            one = {"max_abs_out_err": (out8.cpu().double() - ref8_out).abs().max().item(),
                   "max_abs_lse_err": (lse8.cpu().double() - ref8_lse).abs().max().item(), "path": fp8_path,
                   "config": None if check_cfg is None else check_cfg.to_dict()}
            fp8_check = fp8_check or one  # the default's (or --config's) check, as before
            fp8_checks.append(one)
            _log(f"fp8 check vs float64 on the dequantized cache ({one['config'] or 'default config'}): max |out| "
                 f"err {one['max_abs_out_err']:.2e}, max |lse| err {one['max_abs_lse_err']:.2e} ({fp8_path})")
            if not (one["max_abs_out_err"] <= 2e-2 and one["max_abs_lse_err"] <= 2e-3):
                print("bench_kernel: the fp8 kernel disagrees with float64 on the dequantized cache "
                      f"({one['config'] or 'default config'}); not timing it.", file=sys.stderr)
                return 1
        del k8, v8, k64, v64
    del q, k, v, out, lse
    torch.cuda.empty_cache()

    rows = []
    for b in batches:
        for n in lens:
            bf16_row = None
            for kv_name in kv_dtypes:
                kv_dtype, elem = KV_DTYPES[kv_name]
                fp8 = kv_name == "fp8"
                kv_bytes = 2 * b * n * HKV * HEAD_DIM * elem
                free, _ = torch.cuda.mem_get_info()
                if kv_bytes > 0.7 * free:
                    _log(f"skip B={b} N={n} {kv_name}: K+V need {kv_bytes / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB free")
                    continue
                n_buf = rotation_count(kv_bytes, l2, free, cap=64)
                bufs = []
                for i in range(n_buf):
                    gi = torch.Generator(device="cuda").manual_seed(i + 1)
                    qq = torch.randn(b, HQ, HEAD_DIM, device=dev, dtype=dtype, generator=gi)
                    if fp8:
                        bufs.append((qq, random_fp8(torch, (b, n, HKV, HEAD_DIM), dev, gi),
                                     random_fp8(torch, (b, n, HKV, HEAD_DIM), dev, gi),
                                     torch.full((HKV,), 1 / 448, device=dev), torch.full((HKV,), 1 / 448, device=dev)))
                    else:
                        bufs.append((qq, torch.randn(b, n, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=gi),
                                     torch.randn(b, n, HKV, HEAD_DIM, device=dev, dtype=dtype, generator=gi)))
                shape = DecodeShape(b, HQ, HKV, HEAD_DIM, n)
                # The default config (or --config), then for fp8 each --fp8-configs entry on the same buffers.
                variants = [(user_cfg, False)] + ([(c, True) for c in fp8_extra] if fp8 else [])
                for run_cfg, variant in variants:
                    cfg = resolve_config(run_cfg, shape, kv_dtype, spec, q_dtype=dtype)
                    if fp8:
                        ours, fp8_path = fp8_calls(torch, decode_attention, bufs, run_cfg)
                    else:
                        ours = [functools.partial(decode_attention, qq, kk, vv, config=user_cfg) for qq, kk, vv in bufs]
                    graph = time_calls(ours, dev, repeats=args.repeats)
                    # as a caller runs it:
                    eager = time_calls(ours, dev, repeats=args.repeats, use_graph=False, hold=False)
                    row = {
                        "batch": b, "kv_len": n, "kv_dtype": kv_name, "kv_bytes": kv_bytes, "buffers": n_buf,
                        "variant": variant,
                        "config": cfg.describe(), "config_dict": cfg.to_dict(),
                        "graph_us": graph.device_us, "graph_method": graph.method,
                        "eager_us": eager.device_us, "host_us": eager.host_us,
                        "gbps": kv_bytes / (graph.device_us * 1e-6) / 1e9,
                        "model_us": predict_time_us(cfg, shape, kv_dtype, measured_spec),
                        "sdpa_graph_us": None, "sdpa_eager_us": None, "sdpa_host_us": None, "sdpa_error": None,
                        "fp8_over_bf16": None,
                    }
                    row["frac_copy"] = row["gbps"] / copy_gbps
                    row["eager_over_graph"] = eager.device_us / graph.device_us
                    if fp8 and bf16_row is not None:
                        row["fp8_over_bf16"] = row["graph_us"] / bf16_row["graph_us"]
                    if not fp8 and not variant:
                        bf16_row = row
                    if fp8:
                        row["sdpa_error"] = "SDPA takes no fp8 cache"
                    elif not args.no_sdpa:
                        try:
                            theirs = [functools.partial(sdpa, qq, kk, vv) for qq, kk, vv in bufs]
                            sg = time_calls(theirs, dev, repeats=args.repeats)
                            se = time_calls(theirs, dev, repeats=args.repeats, use_graph=False, hold=False)
                            row.update(sdpa_graph_us=sg.device_us, sdpa_graph_method=sg.method,
                                       sdpa_eager_us=se.device_us, sdpa_host_us=se.host_us)
                        except torch.cuda.OutOfMemoryError as exc:
                            row["sdpa_error"] = f"out of memory: {str(exc).splitlines()[0]}"
                        except RuntimeError as exc:
                            row["sdpa_error"] = str(exc).splitlines()[0]
                    row["device_vs_sdpa"] = row["graph_us"] / row["sdpa_graph_us"] if row["sdpa_graph_us"] else None
                    rows.append(row)
                    _log(
                        f"B={b} N={n} {kv_name} {cfg.describe()}: graph {row['graph_us']:.1f} us "
                        f"({100 * row['frac_copy']:.1f}% of copy), "
                        f"eager {row['eager_us']:.1f} us, host {row['host_us']:.1f} us; SDPA "
                        + (f"{row['sdpa_graph_us']:.1f} us" if row["sdpa_graph_us"] else str(row["sdpa_error"]))
                        + (f"; fp8/bf16 {row['fp8_over_bf16']:.2f}" if row["fp8_over_bf16"] else "")
                    )
                del bufs, ours
                torch.cuda.empty_cache()

    bf16_rows = [r for r in rows if r["kv_dtype"] == "bf16"]
    fp8_rows = [r for r in rows if r["kv_dtype"] == "fp8" and not r["variant"]]  # goals: the default config
    goals = {}
    if bf16_rows:
        goals.update({
            f">= {GOAL_FRACTION:.0%} of copy bandwidth for N >= {GOAL_MIN_LEN}":
                (bf16_rows, [r for r in bf16_rows if r["kv_len"] >= GOAL_MIN_LEN and r["frac_copy"] < GOAL_FRACTION]),
            f"eager host time <= {GOAL_HOST_US:.0f} us at batch 1":
                (bf16_rows, [r for r in bf16_rows if r["batch"] == 1 and r["host_us"] > GOAL_HOST_US]),
            f"eager <= {GOAL_EAGER_OVER_GRAPH}x graph for N >= {GOAL_EAGER_MIN_LEN}":
                (bf16_rows, [r for r in bf16_rows
                             if r["kv_len"] >= GOAL_EAGER_MIN_LEN and r["eager_over_graph"] > GOAL_EAGER_OVER_GRAPH]),
        })
        if not args.no_sdpa:  # with --no-sdpa the goal is not judged (it was reported as missed at every shape)
            goals["device time <= SDPA's at every shape"] = (
                bf16_rows, [r for r in bf16_rows if r["device_vs_sdpa"] is None or r["device_vs_sdpa"] > 1.0])
    if fp8_rows:
        long_fp8 = [r for r in fp8_rows if r["kv_len"] >= GOAL_MIN_LEN]
        paired = [r for r in long_fp8 if r["fp8_over_bf16"] is not None]  # a bf16 row at the same shape ran
        goals.update({
            f"fp8: graph time <= {GOAL_FP8_OVER_BF16}x bf16's for N >= {GOAL_MIN_LEN}":
                (paired, [r for r in paired if r["fp8_over_bf16"] > GOAL_FP8_OVER_BF16]),
            f"fp8: >= {GOAL_FP8_FRACTION:.0%} of copy bandwidth on fp8 bytes for N >= {GOAL_MIN_LEN}":
                (long_fp8, [r for r in long_fp8 if r["frac_copy"] < GOAL_FP8_FRACTION]),
        })
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "device_spec": spec.name,
        "datasheet_bandwidth_gbps": spec.mem_bandwidth_gbps,
        "copy_bandwidth_gbps": copy_gbps,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                  "kv_dtypes": [KV_DTYPES[x][0] for x in kv_dtypes]},
        "fp8_path": fp8_path,
        "timing": "graph: CUDA events around replays of a graph of back-to-back calls; eager: events around eager "
                  "calls; host: issue time per eager call; inputs rotated over buffers >= 3x L2",
        "sdpa_mode": sdpa_mode,
        "check": {"max_abs_out_err": err_out, "max_abs_lse_err": err_lse, "sdpa_max_abs_out_err": sdpa_err,
                  "fp8": fp8_check, "fp8_configs": fp8_checks},
        "goals": {name: {"met": bool(judged) and not missed, "missed_at": [(r["batch"], r["kv_len"]) for r in missed]}
                  for name, (judged, missed) in goals.items()},
    }
    render(rows, meta)
    for name, g in meta["goals"].items():
        print(f"goal {name}: " + ("met" if g["met"] else f"NOT met at {g['missed_at']}"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        from tree_attn.files import atomic_write_text

        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
