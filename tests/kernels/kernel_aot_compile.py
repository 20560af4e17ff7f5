"""Compile the Triton decode kernels ahead of time for real GPU targets, without a GPU.

Run as a script (``python kernel_aot_compile.py``) in a process where ``TRITON_INTERPRET`` is unset:
Triton decides at import time whether its own library functions are interpreted, so compiling in
the same process as interpreter tests is not possible. Prints one JSON object: case id -> facts
(shared memory bytes, whether the PTX has scalar 2-byte global loads, whether K/V go through
16-byte cp.async, and for NVIDIA targets the registers and spill bytes ptxas reports), or the error.

Pointer and stride arguments carry the specialisation a real launch gets (16-byte aligned pointers,
strides divisible by 16), so the generated code is the code a GPU would run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

H100 = ("cuda", 90, 32)
A100 = ("cuda", 80, 32)
RTX4090 = ("cuda", 89, 32)
MI300X = ("hip", "gfx942", 64)

# id -> (kernel, target, dtype, head_dim, block_n, num_stages, num_warps, group, upcast, extra options)
STAGE1_CASES = {
    "h100-bf16-d128-bn64-s2": (H100, "bf16", 128, 64, 2, 4, 4, False, {}),
    "h100-bf16-d128-bn64-s3": (H100, "bf16", 128, 64, 3, 4, 4, False, {}),
    "h100-bf16-d128-bn128-s3-w8": (H100, "bf16", 128, 128, 3, 8, 4, False, {}),
    "h100-fp16-d80-bn64-s2": (H100, "fp16", 80, 64, 2, 4, 4, False, {}),
    "h100-fp32-d64-bn32-s2": (H100, "fp32", 64, 32, 2, 4, 4, True, {}),
    "h100-bf16-d256-bn32-s2-g8": (H100, "bf16", 256, 32, 2, 4, 8, False, {}),
    "a100-bf16-d128-bn32-s4-w2-g1": (A100, "bf16", 128, 32, 4, 2, 1, False, {}),
    "rtx4090-fp16-d128-bn64-s2": (RTX4090, "fp16", 128, 64, 2, 4, 4, False, {}),
    "mi300x-bf16-d128-bn64-s1-wpe2": (MI300X, "bf16", 128, 64, 1, 4, 4, False, {"waves_per_eu": 2}),
    "mi300x-bf16-d96-bn64-s2": (MI300X, "bf16", 96, 64, 2, 4, 4, False, {}),
    # MQA-like groups: 64 query rows per program (Hopper lowers the dots to wgmma, other GPUs to mma).
    "h100-bf16-d128-bn128-s3-g64-spills": (H100, "bf16", 128, 128, 3, 4, 64, False, {}),
    "h100-bf16-d128-bn32-s1-g64": (H100, "bf16", 128, 32, 1, 4, 64, False, {}),
    "rtx4090-bf16-d256-bn32-s3-g64-spills": (RTX4090, "bf16", 256, 32, 3, 4, 64, False, {}),
    "a100-bf16-d128-bn64-s3-g64": (A100, "bf16", 128, 64, 3, 4, 64, False, {}),
    # fp32 defaults (half-size tiles), and tiles past the spill boundary that tuning must not offer.
    "h100-fp32-d256-bn16-s2": (H100, "fp32", 256, 16, 2, 4, 4, True, {}),
    "h100-fp32-d128-bn32-s2": (H100, "fp32", 128, 32, 2, 4, 4, True, {}),
    "h100-fp32-d256-bn32-s2-spills": (H100, "fp32", 256, 32, 2, 4, 4, True, {}),
    "h100-fp32-d64-bn64-s2-w2-spills": (H100, "fp32", 64, 64, 2, 2, 4, True, {}),
    "h100-bf16-d128-bn128-s3-w2-spills": (H100, "bf16", 128, 128, 3, 2, 4, False, {}),
    # Paged KV and several query tokens per row (group = the tile's rows, Sq x the GQA group; the
    # kernel's own GROUP and Q_LEN are in STAGE1_KERNEL_CONSTS): vLLM's 16-token pages under 64-key
    # tiles (a block id per key), FlashAttention's 256-token pages (one block id per tile), and
    # speculative verification of 4 and 8 tokens, causal.
    "h100-bf16-d128-bn64-s2-paged16": (H100, "bf16", 128, 64, 2, 4, 4, False, {}),
    "h100-bf16-d128-bn64-s2-paged256": (H100, "bf16", 128, 64, 2, 4, 4, False, {}),
    "h100-bf16-d128-bn64-s2-sq4-causal": (H100, "bf16", 128, 64, 2, 4, 16, False, {}),
    "h100-bf16-d128-bn32-s2-paged16-sq8-causal": (H100, "bf16", 128, 32, 2, 4, 64, False, {}),
    "mi300x-bf16-d128-bn64-s1-paged16-sq4-causal": (MI300X, "bf16", 128, 64, 1, 4, 16, False, {"waves_per_eu": 2}),
}
# Kernel constexprs of the cases above that are not the defaults (one token, contiguous KV).
STAGE1_KERNEL_CONSTS = {
    "h100-bf16-d128-bn64-s2-paged16": dict(PAGED=True, PAGE_SIZE=16),
    "h100-bf16-d128-bn64-s2-paged256": dict(PAGED=True, PAGE_SIZE=256),
    "h100-bf16-d128-bn64-s2-sq4-causal": dict(GROUP=4, Q_LEN=4, CAUSAL=True),
    "h100-bf16-d128-bn32-s2-paged16-sq8-causal": dict(GROUP=8, Q_LEN=8, CAUSAL=True, PAGED=True, PAGE_SIZE=16),
    "mi300x-bf16-d128-bn64-s1-paged16-sq4-causal": dict(GROUP=4, Q_LEN=4, CAUSAL=True, PAGED=True, PAGE_SIZE=16),
}
# stage two: (target, FAULTY_IS_EMPTY): our own splits (NaN poisons the row) and the public merge rule
STAGE2_CASES = {
    "h100-stage2": (H100, False), "h100-stage2-faulty-empty": (H100, True),
    "mi300x-stage2": (MI300X, False), "mi300x-stage2-faulty-empty": (MI300X, True),
}

DIVISIBLE = (
    "Q", "K", "V", "SEQ_LENS", "BLOCK_TABLE", "O_PART", "LSE_PART", "OUT", "LSE_OUT", "stride_qb", "stride_qt",
    "stride_qh", "stride_ot", "stride_kb",
    "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh", "stride_ob", "stride_oh", "stride_os",
    "stride_lb", "stride_lh", "split_len", "stride_pb", "stride_ph", "stride_ps",
)


def _compile(fn, sig, consts, target, options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for k in consts:
        sig[k] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget(*target), options=options)


def _ptxas() -> str | None:
    """The ptxas Triton ships (it compiles with it), or None."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # The newer of the two first: Triton may emit a PTX version the older one does not read.
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).is_file() and os.access(bin_dir / name, os.X_OK):
            return str(bin_dir / name)
    return None


def _register_facts(ptx: str, arch: int) -> dict:
    """Registers per thread and spill-store bytes, from ``ptxas -v`` on the generated PTX."""
    ptxas = _ptxas()
    if ptxas is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    if proc.returncode != 0 or regs is None or spill is None:
        return {"ptxas_error": text[-500:]}
    return {"registers": int(regs.group(1)), "spill_store_bytes": int(spill.group(1))}


def _facts(kernel, target):
    facts = {"ok": True, "shared": int(kernel.metadata.shared)}
    if target[0] == "cuda":
        ptx = kernel.asm["ptx"]
        facts["scalar_b16_loads"] = bool(re.search(r"ld\.global(\.\w+)*\.(b16|u16)\b", ptx))
        facts["cp_async_16"] = bool(re.search(r"cp\.async\.c[ga]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x10|16)\b", ptx))
        facts.update(_register_facts(ptx, target[1]))
    return facts


def main() -> None:
    from tree_attn.kernels import triton_decode as td
    from tree_attn.kernels.config import group_block

    results = {}
    for cid, (target, dtype, d, bn, stages, warps, group, upcast, extra) in STAGE1_CASES.items():
        fn = td.split_kv_stage1_kernel
        sig = {n: "i32" for n in fn.arg_names}
        sig.update(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}", SEQ_LENS="*i32", BLOCK_TABLE="*i32", O_PART="*fp32",
                   LSE_PART="*fp32", qk_scale_log2="fp32")
        consts = dict(
            GROUP=group, Q_LEN=1, CAUSAL=False, PAGED=False, PAGE_SIZE=1,
            HEAD_DIM=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()), BLOCK_G=group_block(group), BLOCK_N=bn,
            STRIDE_QD=1, STRIDE_KD=1, STRIDE_VD=1, HAS_SEQ_LENS=True, UPCAST=upcast, DOT_PRECISION="ieee",
        )
        consts.update(STAGE1_KERNEL_CONSTS.get(cid, {}))
        try:
            results[cid] = _facts(_compile(fn, sig, consts, target, dict(num_warps=warps, num_stages=stages, **extra)), target)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[cid] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    for cid, (target, faulty_is_empty) in STAGE2_CASES.items():
        fn = td.split_kv_stage2_kernel
        sig = {n: "i32" for n in fn.arg_names}
        sig.update(O_PART="*fp32", LSE_PART="*fp32", OUT="*bf16", LSE_OUT="*fp32")
        try:
            results[cid] = _facts(_compile(fn, sig, dict(HEAD_DIM=128, BLOCK_D=128, SPLIT_TILE=16, FAULTY_IS_EMPTY=faulty_is_empty), target, dict(num_warps=4)), target)
        except Exception as exc:  # noqa: BLE001
            results[cid] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(json.dumps(results))


if __name__ == "__main__":
    # Compiled mode: only when run as a script (importing this module for its case tables must not
    # change the importing process's Triton mode).
    os.environ.pop("TRITON_INTERPRET", None)
    main()
