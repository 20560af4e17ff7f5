"""How the paper's own single-layer scripts time tree and ring, measured on JAX's host devices.

The paper's repository (github.com/Zyphra/tree_attention, commit 3ba6328) times its single-layer
decode (``tree_shard_test.py``, ``ring_shard_test.py``: 1 query token, 16 heads x 128, fp16, the KV
sequence sharded over every device) with ``time.time()`` around the **first** call of a ``jax.jit``
function. Tracing, XLA compilation and the collectives' first-time setup are inside that one timed
call, and there is no warm-up. The cost model (``tree_attn.cost``) predicts a compiled decode step.
This script measures, on the same two programs, what that difference is worth:

- ``first``: the paper's timing, one call in a fresh process (the data are made before the timer,
  as the paper's scripts make them);
- ``steady``: the median of ``--steady-calls`` calls after it (what a decode step costs);
- ``one-off``: ``first - steady``, the part of the first call a decode loop pays once;
- ``compile``: ``jit(...).lower(...).compile()`` alone, in another fresh process: the part of the
  one-off cost that is tracing and XLA compilation (the rest is the first execution's set-up).

The programs are the published ones, re-written here with JAX's public API. Two stand-ins:
- ``flash_attn_jax``'s kernels need a CUDA GPU. Local attention (out and lse) is written in
  ``jnp``.
- Data are float32. XLA's CPU backend has no fast fp16 dot, and this script times program
  structure, not arithmetic.

The tree program takes the paper's three collectives (``pmax`` of lse, ``psum`` of the weighted out,
``psum`` of the weights). The ring program takes the structure of the ring the paper's script calls
(``flash_attn_jax.ring_attention.ring_fwd``, read at version 0.6.2): a ``lax.scan`` over
``axis_size`` steps, each computing attention on the K/V block it holds, merging it into the running
(out, lse), and ``ppermute``-ing K and V to the next device.

The devices are XLA host devices (``--xla_force_host_platform_device_count``): a GPU's
compile and NCCL set-up times are not these. The table therefore shows two things, and the last
table turns them into a prediction:
1. the one-off cost of each program's first call, and its compile part, in ms;
2. how a first-call timing compresses ring/tree compared with steady calls of the same programs.
The paper's headline is 128 H100s at 5.12M tokens. For it, the cost model's steady step
(built-in ``h100-sxm`` preset) plus each program's measured compile time, or its whole one-off
cost, gives the ratio that a first-call timing would report. It is an order-of-magnitude check
of the explanation in RESULTS.md, not a GPU measurement.

Needs JAX (``pip install jax``, CPU build). Of tree-attn it uses only the cost model (pure Python),
for the last table. Nothing here asserts a time.

    python benchmarks/bench_paper_harness.py                  # 8, 32 and 128 devices, about 5 minutes
    python benchmarks/bench_paper_harness.py --devices 8 --repeats 5 --json harness.json
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

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
HEADS, HEAD_DIM = 16, 128  # the paper's scripts


def _child(devices: int, tokens: int, strategy: str, mode: str, steady_calls: int) -> dict:
    """One measurement in this (fresh) process: XLA_FLAGS was set by the parent before JAX loads.

    ``mode``: ``paper`` (the first call as the paper times it, then steady calls) or ``compile``.
    """
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    try:  # JAX >= 0.6: jax.shard_map, whose replication check is `check_vma`
        from jax import shard_map as _shard_map

        shard_map = partial(_shard_map, check_vma=False)
    except ImportError:  # older JAX, as the paper's 0.4.31
        from jax.experimental.shard_map import shard_map as _shard_map

        shard_map = partial(_shard_map, check_rep=False)

    if jax.device_count() != devices:
        raise SystemExit(f"JAX sees {jax.device_count()} devices, expected {devices}")
    mesh = Mesh(np.array(jax.devices()), ("i",))
    seq = Spec(None, "i", None, None)  # [B, T, H, D], T sharded

    @partial(jax.jit, static_argnums=0)
    def make_data(shape):
        b, heads, t, d = shape
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(kq, (b, 1, heads, d), jnp.float32)
        k = jax.lax.with_sharding_constraint(jax.random.normal(kk, (b, t, heads, d), jnp.float32),
                                             NamedSharding(mesh, seq))
        v = jax.lax.with_sharding_constraint(jax.random.normal(kv, (b, t, heads, d), jnp.float32),
                                             NamedSharding(mesh, seq))
        return q, k, v

    def local(q, k, v):
        """q [B,1,H,D], k/v [B,t,H,D] -> out [B,1,H,D], lse [B,1,H,1]; softmax scale 1, as the paper's."""
        s = jnp.einsum("bqhd,bkhd->bqhk", q, k)
        lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)
        return jnp.einsum("bqhk,bkhd->bqhd", jnp.exp(s - lse), v), lse

    specs = dict(mesh=mesh, in_specs=(Spec(), seq, seq), out_specs=Spec())

    @jax.jit
    @partial(shard_map, **specs)
    def tree_decode(q, k, v):
        out, lse = local(q, k, v)
        top = jax.lax.pmax(lse, "i")
        num = jax.lax.psum(out * jnp.exp(lse - top), "i")
        den = jax.lax.psum(jnp.exp(lse - top), "i")
        return num / den

    ring_perm = [(i, (i + 1) % devices) for i in range(devices)]

    @jax.jit
    @partial(shard_map, **specs)
    def ring_decode(q, k, v):
        def step(carry, _):
            k_blk, v_blk, out, lse = carry
            out2, lse2 = local(q, k_blk, v_blk)
            new = jnp.logaddexp(lse, lse2)
            out = out * jnp.exp(lse - new) + out2 * jnp.exp(lse2 - new)
            return (jax.lax.ppermute(k_blk, "i", ring_perm), jax.lax.ppermute(v_blk, "i", ring_perm), out, new), None

        start = (k, v, jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3] + (1,), -jnp.inf, jnp.float32))
        (_, _, out, _), _ = jax.lax.scan(step, start, None, devices)  # axis_size steps, as the paper's
        return out

    q, k, v = make_data((1, HEADS, tokens, HEAD_DIM))
    jax.block_until_ready((q, k, v))
    fn = tree_decode if strategy == "tree" else ring_decode
    if mode == "compile":  # trace + XLA compile alone, in a process of its own (no execution)
        t0 = time.perf_counter()
        fn.lower(q, k, v).compile()
        return {"devices": devices, "strategy": strategy, "compile_ms": (time.perf_counter() - t0) * 1e3}
    # The paper's timing: the first call of the jitted function, block_until_ready, nothing before.
    t0 = time.perf_counter()
    out = fn(q, k, v).block_until_ready()
    first_s = time.perf_counter() - t0
    steady = []
    for _ in range(steady_calls):
        t0 = time.perf_counter()
        fn(q, k, v).block_until_ready()
        steady.append(time.perf_counter() - t0)
    # The two programs must agree with a float64 reference, or their times mean nothing.
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bqhk", qn, kn)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bqhk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vn)
    err = float(np.abs(np.asarray(out, np.float64) - ref).max())
    return {"devices": devices, "tokens": tokens, "strategy": strategy, "first_ms": first_s * 1e3,
            "steady_ms": statistics.median(steady) * 1e3, "max_abs_err": err, "jax": jax.__version__}


def _measure(devices: int, tokens: int, strategy: str, mode: str, steady_calls: int, timeout: float) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, "--child", str(devices), str(tokens), strategy, mode,
           "--steady-calls", str(steady_calls)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} at {devices} devices failed ({proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _headline(one_off: dict[int, dict[str, dict[str, float]]]) -> list[dict] | None:
    """The cost model's steady step at the paper's headline, plus the one-off costs measured here.

    ``one_off[devices][strategy]`` holds ``compile_ms`` (trace + compile: the clean part) and
    ``one_off_ms`` (the whole first call minus a steady call).
    """
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    try:
        from benchmarks.bench_costmodel import paper_predictions
    except ImportError as err:  # tree-attn's cost model needs its own dependencies (PyYAML)
        print(f"(headline check skipped: {err})", file=sys.stderr)
        return None
    head = paper_predictions()["headline"]
    tree_ms, ring_ms = head["tree_us"] / 1e3, head["ring_us"] / 1e3
    rows = []
    for devices, cost in sorted(one_off.items()):
        for part in ("compile_ms", "one_off_ms"):
            add_tree, add_ring = cost["tree"][part], cost["ring"][part]
            rows.append({"from_devices": devices, "added": part, "model_tree_ms": tree_ms, "model_ring_ms": ring_ms,
                         "added_tree_ms": add_tree, "added_ring_ms": add_ring,
                         "first_call_ratio": (ring_ms + add_ring) / (tree_ms + add_tree),
                         "steady_ratio": head["ring_over_tree"], "paper_ratio": head["setup"]["ring_over_tree"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="8,32,128", help="XLA host device counts, comma-separated")
    ap.add_argument("--tokens-per-device", type=int, default=32,
                    help="KV tokens per device (small: the one-off cost, not arithmetic, is measured)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per program and device count")
    ap.add_argument("--steady-calls", type=int, default=5, help="calls after the first, for the steady time")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--child", nargs=4, metavar=("DEVICES", "TOKENS", "STRATEGY", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        devices, tokens, strategy, mode = args.child
        print(json.dumps(_child(int(devices), int(tokens), strategy, mode, args.steady_calls)))
        return 0
    if args.json:  # tree-attn (PyYAML) only where it writes, as below
        from tree_attn.files import exit_if_unwritable

        exit_if_unwritable(ap, {"--json": args.json})
    try:
        import jax  # only to say early that it is missing
    except ImportError:
        print("this benchmark needs JAX: pip install jax", file=sys.stderr)
        return 2
    try:
        device_counts = [int(x) for x in args.devices.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--devices takes whole numbers, comma-separated, not {args.devices!r}")
    if not device_counts or min(device_counts) < 2:
        ap.error("--devices needs counts >= 2")
    if min(args.repeats, args.tokens_per_device, args.steady_calls) < 1:
        ap.error("--repeats, --tokens-per-device and --steady-calls must be >= 1")

    rows, one_off = [], {}
    print(f"{'devices':>7} {'tokens':>7} {'program':>7} {'first ms':>9} {'steady ms':>9} {'one-off ms':>10} "
          f"{'compile ms':>10} {'max err':>8}", flush=True)
    for devices in device_counts:
        tokens = devices * args.tokens_per_device
        per = {}
        for strategy in ("tree", "ring"):
            runs = []
            for r in range(args.repeats):
                print(f"  {strategy} at {devices} devices, processes {2 * r + 1}-{2 * r + 2} of {2 * args.repeats} ...",
                      file=sys.stderr, flush=True)
                paper = _measure(devices, tokens, strategy, "paper", args.steady_calls, args.timeout)
                paper["compile_ms"] = _measure(devices, tokens, strategy, "compile", 0, args.timeout)["compile_ms"]
                runs.append(paper)
            med = {key: statistics.median(x[key] for x in runs) for key in ("compile_ms", "first_ms", "steady_ms")}
            med["one_off_ms"] = statistics.median(x["first_ms"] - x["steady_ms"] for x in runs)
            err = max(x["max_abs_err"] for x in runs)
            per[strategy] = med
            rows.append({"devices": devices, "tokens": tokens, "strategy": strategy, **med, "max_abs_err": err,
                         "each": [{k: x[k] for k in ("compile_ms", "first_ms", "steady_ms")} for x in runs]})
            print(f"{devices:>7} {tokens:>7} {strategy:>7} {med['first_ms']:>9.1f} {med['steady_ms']:>9.2f} "
                  f"{med['one_off_ms']:>10.1f} {med['compile_ms']:>10.1f} {err:>8.1e}", flush=True)
        one_off[devices] = per
        print(f"{'':>7} ring/tree: first call {per['ring']['first_ms'] / per['tree']['first_ms']:.2f}x, "
              f"steady {per['ring']['steady_ms'] / per['tree']['steady_ms']:.2f}x", flush=True)

    headline = _headline(one_off)
    if headline:
        print("\npaper headline (128 H100, 5.12M tokens): the cost model's steady step + a one-off cost measured above")
        print(f"{'from':>8} {'added':>10} {'tree ms':>9} {'ring ms':>9} {'first-call ring/tree':>20} {'steady':>7} "
              f"{'paper':>6}")
        for h in headline:
            print(f"{str(h['from_devices']) + ' dev':>8} {h['added'].removesuffix('_ms'):>10} "
                  f"{h['model_tree_ms'] + h['added_tree_ms']:>9.1f} {h['model_ring_ms'] + h['added_ring_ms']:>9.1f} "
                  f"{h['first_call_ratio']:>19.2f}x {h['steady_ratio']:>6.0f}x {h['paper_ratio']:>5.0f}x")
    if args.json:
        import jax

        meta = {"machine": platform.machine(), "processor": platform.processor(),
                "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
                "tokens_per_device": args.tokens_per_device, "repeats": args.repeats,
                "steady_calls": args.steady_calls, "load_avg": os.getloadavg()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from tree_attn.files import atomic_write_text

        atomic_write_text(args.json, json.dumps({"meta": meta, "results": rows, "headline": headline}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
