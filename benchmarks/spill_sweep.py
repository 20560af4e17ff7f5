"""Register spills of the decode kernel's stage one over the tuning space, against the spill rule.

A compile-time sweep, not a GPU run: every point is a real launch (``kernel_aot_compile.plan``:
the launcher's own plan of CPU tensors of the call's shapes, dtypes and strides) with an explicit
config, built by the installed Triton for sm_90 / sm_89 under a stand-in driver, and ptxas's
``-v`` report of the build (registers, spill-store bytes) is set against
``kernels.config.stage1_spill_free`` for the installed Triton. This is the data the rule is fitted
to; rerun it when Triton (or the ptxas it runs) changes:

    python benchmarks/spill_sweep.py --rule-passes --jobs 2 --out spills.json   # every kind, sm_90 + sm_89
    python benchmarks/spill_sweep.py --kinds fp32,fp32-gather --targets h100 --stages 3
    python benchmarks/spill_sweep.py --report spills.json    # re-judge saved builds by the rule as it is now

The grid of each kind: D 64/128/256 x padded query rows 16/32/64 (GQA groups of 16/32/64 over 2 KV
heads: one KV head is another build, Triton folds it into the code) x keys per tile (32/64/128 for
tensor-core dots, 16/32/64 for fp32's FMA dots) x 2/4/8 warps, at ``--stages`` pipeline stages.
Kinds: the dtype mix (q over KV) and the cache layout: contiguous, ``-gather`` (1-token pages:
tiles gathered key by key) or ``-paged`` (256-token pages: one block id per tile). Prints one row
per kind and writes every build's facts as JSON. The pass region at 2 stages (``--rule-passes``,
about 950 builds) took 5 min wall with ``--jobs 2`` on a 2-core VM under Triton 3.9, 21 min
under 3.6 on the same VM while it was busier; the builds it leaves out, which spill heavily, take
several seconds each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_AOT = _ROOT / "tests" / "kernels"
for _p in (_ROOT, _AOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# kind -> (q dtype, KV dtype, page size: 0 contiguous, 1 gathered key by key, 256 whole tiles)
_LAYOUTS = {"": 0, "-gather": 1, "-paged": 256}
KINDS = {f"{d}{layout}": (d, d, page) for d in ("bf16", "fp32") for layout, page in _LAYOUTS.items()}
KINDS |= {f"q-{q}-kv-bf16": (q, "bf16", 0) for q in ("fp16", "fp32")}
KINDS |= {"fp8": ("bf16", "fp8", 0), "fp8-gather": ("bf16", "fp8", 1)}
KINDS |= {f"q-{q}-fp8": (q, "fp8", 0) for q in ("fp16", "fp32")}
HEAD_DIMS = (64, 128, 256)
ROWS = (16, 32, 64)
WARPS = (2, 4, 8)
KV_HEADS = 2


def _launch(kind: str, d: int, rows: int, block_n: int, warps: int, stages: int):
    from kernel_aot_compile import Launch, cfg

    q, kv, page = KINDS[kind]
    n = 2048 if page == 1 else 8192
    return Launch(q, kv, 1, rows * KV_HEADS, KV_HEADS, d, n, page=page,
                  config=cfg(block_n=block_n, num_warps=warps, num_stages=stages))


def grid(kinds: list[str], targets: list[str], stages: int) -> dict[str, tuple[str, str, tuple]]:
    """id -> (target, kind, (d, rows, block_n, warps, stages))."""
    out = {}
    for kind in kinds:
        fp32 = KINDS[kind][1] == "fp32"
        tiles = (16, 32, 64) if fp32 else (32, 64, 128)
        for target, d, rows, block_n, warps in itertools.product(targets, HEAD_DIMS, ROWS, tiles, WARPS):
            point = (d, rows, block_n, warps, stages)
            out[f"{target}-{kind}-d{d}-r{rows}-bn{block_n}-w{warps}-s{stages}"] = (target, kind, point)
    return out


def _predict(point: tuple[str, str, tuple], profile=None) -> bool:
    """What ``stage1_spill_free`` says of a grid point (``profile``: None = the installed Triton's)."""
    from kernel_aot_compile import _DTYPES

    from tree_attn.kernels.config import stage1_spill_free
    from tree_attn.kernels.shapes import DecodeShape

    _target, kind, (d, rows, block_n, warps, _stages) = point
    q, kv, page = KINDS[kind]
    n = 2048 if page == 1 else 8192
    shape = DecodeShape(batch=1, q_heads=rows * KV_HEADS, kv_heads=KV_HEADS, head_dim=d, kv_len=n, block_size=page,
                        num_blocks=n // page if page else 0)
    return stage1_spill_free(block_n, warps, shape, _DTYPES[kv], 32, q_dtype=_DTYPES[q], profile=profile)


def _worker(ids: list[str], stages: int) -> None:
    """In a fresh process (compiled mode, own Triton cache): build each id, print one JSON line."""
    import os
    import shutil
    import tempfile

    os.environ.pop("TRITON_INTERPRET", None)
    cache = tempfile.mkdtemp(prefix="tree-attn-spills-")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        import kernel_aot_compile as aot
        from triton import knobs

        knobs.nvidia.dump_ptxas_log = True
        points = grid(list(KINDS), list(aot.TARGETS), stages)
        for cid in ids:
            target, kind, point = points[cid]
            aot.CASES[cid] = (target, _launch(kind, *point))
        drivers = {name: aot._TargetDriver(aot.TARGETS[name][0], i) for i, name in enumerate(aot.TARGETS)}
        print(json.dumps({cid: aot.run_case(cid, drivers) for cid in ids}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _ptxas_versions(targets: list[str]) -> dict[str, str]:
    """The ptxas each target's builds ran (Triton picks one per architecture)."""
    from kernel_aot_compile import TARGETS
    from triton.backends.nvidia import compiler

    out = {}
    for t in targets:
        arch = TARGETS[t][0][1]
        try:
            text = subprocess.run([compiler.get_ptxas(arch).path, "--version"], capture_output=True, text=True,
                                  check=True).stdout
            out[t] = text.strip().splitlines()[-1]
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[t] = f"unknown ({exc})"
    return out


def _run(ids: list[str], stages: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", "--stages", str(stages), *ids],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(builds: list[dict], triton_version: str) -> None:
    """One row per kind: the builds, those ptxas spilled, and where the rule of ``triton_version``'s
    profile (as the code stands now) disagrees; then each build it passes that spills."""
    from tree_attn.kernels.config import spill_profile

    profile = spill_profile(triton_version)
    table: dict[str, list[int]] = {}
    passed_spilled = []
    for row in builds:
        t = table.setdefault(row["kind"], [0, 0, 0, 0, 0])
        if row["error"] is not None:
            t[4] += 1
            continue
        point = (row["target"], row["kind"], (row["head_dim"], row["rows"], row["block_n"], row["num_warps"],
                                               row["num_stages"]))
        rule, spilled = _predict(point, profile), row["spill_store_bytes"] > 0
        t[0] += 1
        t[1] += spilled
        t[2] += rule and spilled
        t[3] += (not rule) and not spilled
        if rule and spilled:
            passed_spilled.append(row)
    print(f"rule: {profile.name}")
    print("| kind | builds | spilled | rule passes but spilled | rule prunes, no spill | errors |")
    print("|---|---|---|---|---|---|")
    for kind, (n, sp, bad_pass, over, err) in table.items():
        print(f"| {kind} | {n} | {sp} | {bad_pass} | {over} | {err} |")
    for row in passed_spilled:
        print(f"  rule passes, spills: {row['id']}: {row['registers']} registers, {row['spill_store_bytes']} B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    ap.add_argument("--targets", default="h100,rtx4090", help="h100 (sm_90) and/or rtx4090 (sm_89)")
    ap.add_argument("--stages", type=int, default=2, help="num_stages of every build (default 2)")
    ap.add_argument("--jobs", type=int, default=1, help="compile processes side by side (default 1)")
    ap.add_argument("--rule-passes", action="store_true",
                    help="build only the points some Triton's spill profile passes (the configs a default or a "
                         "tuning candidate can be; the rest are the slow, heavily spilling builds)")
    ap.add_argument("--out", help="write every build's facts here (JSON)")
    ap.add_argument("--report", nargs="+", metavar="JSON",
                    help="build nothing: judge the builds of earlier --out files by the rule as it stands now "
                         "(for the Triton that built them)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("ids", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.ids, args.stages)
        return
    if args.report:
        for path in args.report:
            data = json.loads(Path(path).read_text())
            meta = data["meta"]
            print(f"{path}: triton {meta['triton']}, ptxas {meta['ptxas']}")
            report(data["builds"], meta["triton"])
        return
    from tree_attn.files import exit_if_unwritable

    exit_if_unwritable(ap, {"--out": args.out})  # before the builds (minutes)
    import triton

    from tree_attn.kernels.config import SPILL_PROFILES

    kinds = [k for k in args.kinds.split(",") if k]
    targets = [t for t in args.targets.split(",") if t]
    bad = [k for k in kinds if k not in KINDS] + [t for t in targets if t not in ("h100", "rtx4090")]
    if bad:
        raise SystemExit(f"unknown kind/target: {', '.join(bad)}")
    points = grid(kinds, targets, args.stages)
    if args.rule_passes:
        points = {cid: p for cid, p in points.items() if any(_predict(p, prof) for prof in SPILL_PROFILES.values())}
    ids = list(points)
    chunks = [ids[i:i + 24] for i in range(0, len(ids), 24)]
    facts: dict[str, dict] = {}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for done, part in enumerate(pool.map(lambda c: _run(c, args.stages), chunks), 1):
            facts.update(part)
            print(f"  {sum(map(len, chunks[:done]))}/{len(ids)} builds", file=sys.stderr, flush=True)

    builds = []
    for cid, (target, kind, (d, rows, block_n, warps, stages)) in points.items():
        res = facts[cid]
        s1 = res.get("stage1", {})
        row = dict(id=cid, target=target, kind=kind, head_dim=d, rows=rows, block_n=block_n, num_warps=warps,
                   num_stages=stages, registers=s1.get("registers"), spill_store_bytes=s1.get("spill_store_bytes"),
                   error=res.get("error") or s1.get("ptxas_error"))
        if row["error"] is None:  # the launch took the config it was given
            assert (res["config"]["block_n"], res["config"]["num_warps"]) == (block_n, warps), res["config"]
        builds.append(row)
    ptxas = _ptxas_versions(targets)
    print(f"triton {triton.__version__}, ptxas {ptxas}, {args.stages} stages, targets {', '.join(targets)}")
    report(builds, triton.__version__)
    if args.out:
        meta = dict(triton=triton.__version__, ptxas=ptxas, stages=args.stages, targets=targets,
                    python=platform.python_version(), machine=platform.machine())
        from tree_attn.files import atomic_write_text

        atomic_write_text(args.out, json.dumps(dict(meta=meta, builds=builds), indent=1))


if __name__ == "__main__":
    main()
