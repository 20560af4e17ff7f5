#!/usr/bin/env python
"""Instructions per iteration of the decode kernel's tile loop, from its compiled SASS (no GPU needed).

Compile-time facts, not timings: stage one of real launches (Llama-3.1-8B attention per GPU: 32
query heads, 8 KV heads, D=128, a bf16 query, batch 1, 64K keys) is built ahead of time for sm_90
(or ``--target sm_89``) exactly as ``tests/kernels/kernel_aot_compile.py`` builds it (the launcher
plans the call, ``JITFunction.run(warmup=True)`` compiles it under a stand-in driver), its cubin is
disassembled with ``nvdisasm`` (Triton's bundled copy, else the one on PATH), and the body of the
loop that walks the split's tiles (the longest backward branch) is counted by opcode: per thread,
per iteration, i.e. per ``block_n`` keys. Rows: the bf16 cache and the fp8 cache at their default
configs, plus any ``--fp8-configs``.

What to read in it: ``HMMA`` (the dots' tensor-core ops), ``F2FP`` (conversions: fp8 -> fp16
widening two elements at a time, fp32 -> 16-bit packs), ``LDS*``/``LDSM*``/``STS*`` (shared memory:
``LDS.U8`` is a one-byte read), ``LDGSTS`` (cp.async global -> shared), ``IMAD.MOV`` (register
moves), registers (ptxas) and shared memory per program, and bytes of K/V per iteration.

    python benchmarks/sass_loop.py [--target sm_90] [--fp8-configs '[{"block_n": 128, "num_warps": 8}]']
                                   [--out benchmarks/out/sass_loop.json]

Run it in a process without ``TRITON_INTERPRET`` (Triton decides at import whether it interprets).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "tests" / "kernels"))

TARGETS = {"sm_90": "h100", "sm_89": "rtx4090"}  # kernel_aot_compile's target names
# Columns of the table: an opcode's first dot-separated part, or (for these) its full form.
COLUMNS = ("HMMA", "HGMMA", "F2FP", "LDS", "LDS.U8", "LDSM", "STS", "LDGSTS", "IMAD.MOV", "PRMT", "BAR")


def nvdisasm() -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    found = str(bundled) if bundled.exists() else shutil.which("nvdisasm")
    if not found:
        raise SystemExit("sass_loop: no nvdisasm (neither Triton's bundled copy nor one on PATH)")
    return found


def loop_body(sass: str) -> list[str]:
    """Opcodes (with modifiers) of the longest loop: from a label to the last branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            span = (labels[m.group(1)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise RuntimeError("no loop in this kernel's SASS")
    ops = []
    for line in lines[best[0]:best[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops


def count(ops: list[str]) -> dict[str, int]:
    first = collections.Counter(op.split(".")[0] for op in ops)
    full = collections.Counter(ops)
    out = {"total": len(ops)}
    for col in COLUMNS:
        if col == "LDS.U8":
            out[col] = full["LDS.U8"] + full["LDS.S8"]
        elif col == "IMAD.MOV":
            out[col] = sum(v for k, v in full.items() if k.startswith("IMAD.MOV"))
        else:
            out[col] = first[col]
    out["by_opcode"] = dict(sorted(full.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def build(target_name: str, launch, disasm: str, workdir: Path, label: str) -> dict:
    import kernel_aot_compile as aot
    from triton.runtime.driver import driver

    driver.set_active(aot._TargetDriver(aot.TARGETS[target_name][0], 0))
    tl, launches = aot.plan(target_name, launch)
    kernel, grid, args, kwargs = launches[0]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # ptxas -v (TRITON_DUMP_PTXAS_LOG)
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    cubin = workdir / f"{label}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.findall(r"Used (\d+) registers", log.getvalue())
    spill = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    cfg = tl.config
    kv_bytes = 2 * cfg.block_n * launch.d * (1 if launch.kv.startswith("fp8") else 2)
    return {
        "kv": launch.kv, "q": launch.q, "config": cfg.describe(), "config_dict": cfg.to_dict(),
        "registers": int(regs[0]) if regs else None, "spill_store_bytes": int(spill[0]) if spill else None,
        "shared_bytes": int(compiled.metadata.shared), "kv_bytes_per_iteration": kv_bytes,
        "loop": count(loop_body(sass)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="sm_90")
    ap.add_argument("--fp8-configs", type=str, default="[]",
                    help='extra fp8 configs as a JSON list of DecodeConfig dicts, e.g. \'[{"block_n": 128}]\'')
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from tree_attn.files import exit_if_unwritable

    exit_if_unwritable(ap, {"--out": args.out})  # before the builds (minutes)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tree-attn-sass-")  # fresh: ptxas runs and logs
    import kernel_aot_compile as aot
    import triton
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    disasm = nvdisasm()
    llama = dict(hq=32, hkv=8, d=128)
    launches = [("bf16 default", aot.Launch("bf16", "bf16", 1, n=65536, **llama)),
                ("fp8 default", aot.Launch("bf16", "fp8", 1, n=65536, **llama))]
    for extra in json.loads(args.fp8_configs):
        launches.append((f"fp8 {extra}", aot.Launch("bf16", "fp8", 1, n=65536, config=aot.cfg(**extra), **llama)))
    rows = []
    work = Path(tempfile.mkdtemp(prefix="tree-attn-sass-bin-"))
    try:
        for label, launch in launches:
            row = build(TARGETS[args.target], launch, disasm, work, f"b{len(rows)}")
            row["label"] = label
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)

    print(f"stage one's tile loop on {args.target} (Triton {triton.__version__}): instructions per thread and "
          "iteration; compile-time facts, nothing here ran")
    head = ["launch", "config", "regs", "smem KiB", "KV B/iter", "instr", *COLUMNS, "instr per KV KiB x warps"]
    print(" | ".join(head))
    for r in rows:
        c = r["loop"]
        warps = r["config_dict"]["num_warps"]
        per_kib = c["total"] * warps / (r["kv_bytes_per_iteration"] / 1024)
        print(" | ".join([r["label"], r["config"], str(r["registers"]), f"{r['shared_bytes'] / 1024:.1f}",
                          str(r["kv_bytes_per_iteration"]), str(c["total"]), *(str(c[k]) for k in COLUMNS),
                          f"{per_kib:.0f}"]))
        r["warp_instructions_per_kv_kib"] = per_kib
    if args.out:
        meta = {"target": args.target, "triton": triton.__version__, "nvdisasm": disasm,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "shape": {"batch": 1, "kv_len": 65536, **llama, "q": "bfloat16"}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        from tree_attn.files import atomic_write_text

        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
