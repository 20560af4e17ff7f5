"""Calibrate the cost model on this machine and write a parameters file for `tree-attn simulate
--params`. On a GPU node this is the run that replaces the presets' assumed single-GPU terms
(the kernel's achieved fraction of the memory bandwidth, its fixed cost, the merge) and the
node's link numbers with measured ones; without a GPU it calibrates CPU ranks.

    python benchmarks/calibrate_costmodel.py --out benchmarks/out/params-<machine>.json
    tree-attn simulate --params benchmarks/out/params-<machine>.json -w 8,16,128 -n 32K,1M,5.12M

Everything here is a micro-measurement (``tree_attn.cost.calibrate``): never a decode run of the
kind the model is checked against (benchmarks/bench_costmodel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "out", "costmodel_params.json"))
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on CPU ranks")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    from tree_attn.files import exit_if_unwritable

    exit_if_unwritable(ap, {"--out": args.out})
    import torch

    from tree_attn.cost.calibrate import calibrate_cpu, calibrate_gpu

    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        sys.exit("calibrate_costmodel: --device cuda, but no CUDA or ROCm GPU is visible (--device cpu calibrates "
                 "CPU ranks)")
    if kind == "cuda":
        cluster = calibrate_gpu(dtype=args.dtype or "bfloat16", repeats=args.repeats)
    else:
        cluster = calibrate_cpu(dtype=args.dtype or "float32", repeats=args.repeats)
    data = cluster.to_dict()
    data["measured"] = {"device": torch.cuda.get_device_name(0) if kind == "cuda" else "cpu",
                        "torch": torch.__version__, "load_average": os.getloadavg()[0]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from tree_attn.files import atomic_write_text

    atomic_write_text(args.out, json.dumps(data, indent=1))
    print(json.dumps(data, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
