"""Compile the Triton decode kernels ahead of time for real GPU targets, without a GPU.

Run as a script (``python kernel_aot_compile.py [case ids...]``) in a process where
``TRITON_INTERPRET`` is unset: Triton decides at import time whether its own library functions are
interpreted, so compiling in the same process as interpreter tests is not possible. Prints one JSON
object: case id -> the launch's config and, per kernel it launches, the build's facts (shared
memory bytes; for NVIDIA targets whether the PTX has scalar 2-byte or 1-byte global loads, how
many one-byte shared-memory reads it has, whether K/V go through 16-byte cp.async, and the
registers and spill bytes ptxas reported and its release; for AMD ones the hardware fp8 conversions
and vector instructions in the code), or the error.

Every case is a real launch: CPU tensors with the shapes, dtypes and strides of the call, planned
by the launcher itself (``TritonDecodeLaunch(..., backend=...)``, or the merge's own views) and
handed to ``JITFunction.run(..., warmup=True)`` under a stand-in driver that reports the target
GPU. So the build carries the specialisations a launch on that GPU derives from its argument
values (16-byte aligned pointers, integers divisible by 16, integers equal to 1 folded into the
code), and the config is the one that launch would pick. The register facts are ptxas's own
report of the build (Triton runs ``ptxas -v``), in a fresh Triton cache so that every build runs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# name -> (Triton target, the DeviceSpec the default config is chosen for)
TARGETS = {
    "h100": (("cuda", 90, 32), "h100-sxm"),
    "rtx4090": (("cuda", 89, 32), "rtx4090"),
    "a100": (("cuda", 80, 32), "a100-sxm-80gb"),
    "mi300x": (("hip", "gfx942", 64), "mi300x"),
}


@dataclass(frozen=True)
class Launch:
    """One decode call, described by its tensors (see ``tree_attn.decode_attention``).

    ``q``/``kv``: dtype names; ``sq``: query tokens per row (0: ``q [B, Hq, D]``); ``page``: the
    paged pool's block size (0: a contiguous cache); ``lens``: seq_lens given; ``packed``: outputs
    are the packed ``[B, Hq, D + 1]`` float32 message a reduction sends (a rank's local state),
    else ``out`` in q's dtype; ``config``: a ``DecodeConfig`` as keyword arguments, ``None`` for
    the default the launch picks on the target's device.
    """

    q: str
    kv: str
    b: int
    hq: int
    hkv: int
    d: int
    n: int
    sq: int = 0
    causal: bool = False
    page: int = 0
    lens: bool = True
    packed: bool = False
    config: tuple | None = None  # DecodeConfig fields as (name, value) pairs (hashable)


@dataclass(frozen=True)
class Merge:
    """The tree merge of ``TreeMerge`` on a node with ``children`` children: stage two reading the
    stacked packed messages in place (non-contiguous views, strides of D + 1)."""

    children: int
    b: int
    hq: int
    d: int


def cfg(**kw) -> tuple:
    return tuple(sorted(kw.items()))


# id -> (target, launch). Ids ending in "-spills" are builds that Triton 3.9's ptxas spills registers
# on, which the spill rule (kernels.config.spill_free) prunes under every Triton's profile; under 3.9
# every other build keeps its registers (an older Triton's ptxas keeps some of the "-spills" ones,
# and spills on rtx4090-bf16-d256-mqa-bn32-s3, which its profile prunes).
LLAMA = dict(hq=32, hkv=8, d=128)  # Llama-3 8B/70B per-GPU heads: GQA 4
CASES: dict[str, tuple[str, Launch | Merge]] = {
    # Defaults on Llama shapes: many splits (batch 1, long cache) and one split (batch 64), which
    # writes the caller's 16-bit out directly.
    "h100-bf16-llama-b1-64k": ("h100", Launch("bf16", "bf16", 1, n=65536, **LLAMA)),
    "h100-bf16-llama-b64-1split": ("h100", Launch("bf16", "bf16", 64, n=4096, **LLAMA)),
    "h100-fp16-llama-b64-1split": ("h100", Launch("fp16", "fp16", 64, n=4096, **LLAMA)),
    "rtx4090-fp16-llama-b64-1split": ("rtx4090", Launch("fp16", "fp16", 64, n=4096, **LLAMA)),
    "rtx4090-bf16-llama-b1-1000": ("rtx4090", Launch("bf16", "bf16", 1, n=1000, lens=False, **LLAMA)),
    "a100-bf16-llama-b4-32k": ("a100", Launch("bf16", "bf16", 4, n=32768, **LLAMA)),
    "mi300x-bf16-llama-b1-64k": ("mi300x", Launch("bf16", "bf16", 1, n=65536, **LLAMA)),
    # A rank's local state: the packed float32 message (D + 1 strides, lse at offset 4 D bytes).
    "h100-bf16-llama-packed": ("h100", Launch("bf16", "bf16", 1, n=16384, packed=True, **LLAMA)),
    "h100-bf16-llama-packed-1split": ("h100", Launch("bf16", "bf16", 64, n=4096, packed=True, **LLAMA)),
    # Head dims: 64 and 80 in 16 bits, 256 with an MQA-like group.
    "h100-fp16-d64": ("h100", Launch("fp16", "fp16", 2, 16, 2, 64, 8192)),
    "h100-bf16-d64-1split": ("h100", Launch("bf16", "bf16", 64, 16, 2, 64, 2048)),
    "rtx4090-bf16-d64": ("rtx4090", Launch("bf16", "bf16", 2, 16, 2, 64, 8192)),
    "h100-bf16-d80": ("h100", Launch("bf16", "bf16", 2, 32, 32, 80, 4000)),
    "rtx4090-bf16-d80-1split": ("rtx4090", Launch("bf16", "bf16", 32, 32, 32, 80, 4000)),
    "h100-fp16-d80": ("h100", Launch("fp16", "fp16", 2, 32, 32, 80, 4000)),
    "h100-bf16-d256-mqa": ("h100", Launch("bf16", "bf16", 1, 64, 1, 256, 32768)),
    "rtx4090-bf16-d256-mqa": ("rtx4090", Launch("bf16", "bf16", 1, 64, 1, 256, 32768)),
    "h100-bf16-d128-mqa": ("h100", Launch("bf16", "bf16", 1, 64, 1, 128, 32768)),
    # fp32.
    "h100-fp32-llama": ("h100", Launch("fp32", "fp32", 1, n=16384, **LLAMA)),
    "rtx4090-fp32-llama-1split": ("rtx4090", Launch("fp32", "fp32", 64, n=2048, **LLAMA)),
    "h100-fp32-d256": ("h100", Launch("fp32", "fp32", 1, 8, 8, 256, 8192)),
    "h100-fp32-d64-g64": ("h100", Launch("fp32", "fp32", 1, 64, 1, 64, 8192)),
    "rtx4090-fp32-d64-g64": ("rtx4090", Launch("fp32", "fp32", 1, 64, 1, 64, 8192)),
    "h100-fp32-d128-g32": ("h100", Launch("fp32", "fp32", 1, 32, 1, 128, 8192)),
    "h100-fp32-d256-g64": ("h100", Launch("fp32", "fp32", 1, 64, 1, 256, 8192)),
    "h100-fp32-d256-g64-paged1": ("h100", Launch("fp32", "fp32", 1, 64, 1, 256, 2048, page=1)),
    # 64 query heads per KV head over 2 KV heads, gathered: 8 warps spilled 568 B (1 KV head: none).
    "h100-fp32-d128-g64-kv2-paged1": ("h100", Launch("fp32", "fp32", 1, 128, 2, 128, 2048, page=1)),
    "rtx4090-fp32-d128-g32-paged3": ("rtx4090", Launch("fp32", "fp32", 2, 32, 1, 128, 2049, page=3)),
    # Paged: block sizes that hold whole tiles (one block id per tile) and others (a per-key gather).
    "h100-bf16-paged16": ("h100", Launch("bf16", "bf16", 4, n=8192, page=16, **LLAMA)),
    "h100-bf16-paged256": ("h100", Launch("bf16", "bf16", 4, n=8192, page=256, **LLAMA)),
    "h100-bf16-paged1": ("h100", Launch("bf16", "bf16", 2, n=2048, page=1, **LLAMA)),
    "h100-fp32-paged16": ("h100", Launch("fp32", "fp32", 4, n=8192, page=16, **LLAMA)),
    "h100-fp32-paged1": ("h100", Launch("fp32", "fp32", 2, n=2048, page=1, **LLAMA)),
    "h100-fp32-paged17": ("h100", Launch("fp32", "fp32", 2, n=2040, page=17, **LLAMA)),
    "h100-fp32-paged32": ("h100", Launch("fp32", "fp32", 4, n=8192, page=32, **LLAMA)),
    "h100-fp32-paged256": ("h100", Launch("fp32", "fp32", 4, n=8192, page=256, **LLAMA)),
    "rtx4090-fp32-paged16": ("rtx4090", Launch("fp32", "fp32", 4, n=8192, page=16, **LLAMA)),
    "rtx4090-fp32-paged16-d64": ("rtx4090", Launch("fp32", "fp32", 4, 16, 2, 64, 8192, page=16)),
    # Several query tokens per row (speculative verification), causal; paged too.
    "h100-bf16-sq4-causal": ("h100", Launch("bf16", "bf16", 2, sq=4, causal=True, n=8192, **LLAMA)),
    "h100-bf16-sq8-paged16-causal": ("h100", Launch("bf16", "bf16", 2, sq=8, causal=True, n=8192, page=16, **LLAMA)),
    "mi300x-bf16-sq4-paged16-causal":
        ("mi300x", Launch("bf16", "bf16", 2, sq=4, causal=True, n=8192, page=16, **LLAMA)),
    # Mixed query / KV dtypes.
    "h100-q-fp16-kv-bf16": ("h100", Launch("fp16", "bf16", 1, n=16384, **LLAMA)),
    "rtx4090-q-fp16-kv-bf16": ("rtx4090", Launch("fp16", "bf16", 1, n=16384, **LLAMA)),
    "h100-q-bf16-kv-fp16": ("h100", Launch("bf16", "fp16", 1, n=16384, **LLAMA)),
    "h100-q-fp32-kv-bf16": ("h100", Launch("fp32", "bf16", 1, n=16384, **LLAMA)),
    "h100-q-bf16-kv-fp32": ("h100", Launch("bf16", "fp32", 1, n=16384, **LLAMA)),
    "rtx4090-q-fp32-kv-fp16-1split": ("rtx4090", Launch("fp32", "fp16", 64, n=4096, **LLAMA)),
    "h100-q-fp16-kv-bf16-mqa": ("h100", Launch("fp16", "bf16", 1, 64, 1, 128, 32768)),
    # Explicit configs: the tuning space's edges, on both sides of the spill boundary.
    "h100-bf16-bn64-s3": ("h100", Launch("bf16", "bf16", 1, n=16384, config=cfg(block_n=64, num_stages=3), **LLAMA)),
    "h100-bf16-bn128-s3-w8":
        ("h100", Launch("bf16", "bf16", 1, n=16384, config=cfg(block_n=128, num_stages=3, num_warps=8), **LLAMA)),
    "a100-bf16-g1-bn32-s4-w2":
        ("a100", Launch("bf16", "bf16", 1, 8, 8, 128, 16384, config=cfg(block_n=32, num_stages=4, num_warps=2))),
    "h100-bf16-bn64-w2-spills":
        ("h100", Launch("bf16", "bf16", 1, n=16384, config=cfg(block_n=64, num_warps=2), **LLAMA)),
    "h100-bf16-bn128-s3-w2-spills":
        ("h100", Launch("bf16", "bf16", 1, n=16384, config=cfg(block_n=128, num_stages=3, num_warps=2), **LLAMA)),
    "h100-bf16-mqa-bn128-s3-spills":
        ("h100", Launch("bf16", "bf16", 1, 64, 1, 128, 32768, config=cfg(block_n=128, num_stages=3))),
    "rtx4090-bf16-d256-mqa-bn32-s3":
        ("rtx4090", Launch("bf16", "bf16", 1, 64, 1, 256, 32768, config=cfg(block_n=32, num_stages=3))),
    "a100-bf16-mqa-bn64-s3":
        ("a100", Launch("bf16", "bf16", 1, 64, 1, 128, 32768, config=cfg(block_n=64, num_stages=3))),
    "h100-fp32-d256-bn32-spills": ("h100", Launch("fp32", "fp32", 1, 8, 8, 256, 8192, config=cfg(block_n=32))),
    "h100-fp32-d64-bn64-w2-spills":
        ("h100", Launch("fp32", "fp32", 1, 16, 4, 64, 8192, config=cfg(block_n=64, num_warps=2))),
    "h100-fp32-d64-g64-bn64-spills": ("h100", Launch("fp32", "fp32", 1, 64, 1, 64, 8192, config=cfg(block_n=64))),
    "h100-fp32-paged16-bn32-spills":
        ("h100", Launch("fp32", "fp32", 4, n=8192, page=16, config=cfg(block_n=32), **LLAMA)),
    "h100-q-fp32-kv-fp16-mqa-bn64-spills":
        ("h100", Launch("fp32", "fp16", 1, 64, 1, 128, 32768, config=cfg(block_n=64))),
    "h100-q-fp16-kv-bf16-mqa-bn64-spills":
        ("h100", Launch("fp16", "bf16", 1, 64, 1, 128, 32768, config=cfg(block_n=64))),
    "mi300x-bf16-d96-bn64-s2":
        ("mi300x", Launch("bf16", "bf16", 1, 8, 8, 96, 8192, config=cfg(block_n=64, num_stages=2, waves_per_eu=0))),
    # fp8 caches (e4m3, tiles widened to fp16): defaults over bf16 / fp16 / fp32 queries, many
    # splits and one (which writes the caller's out), head dims, an MQA-like group (wgmma on
    # Hopper), paged with whole tiles per page and gathered, several query tokens, and explicit
    # configs on both sides of the fp8 spill boundary (and the 2-stage config the H100 default
    # replaced). On gfx942: AMD's fnuz format (hardware conversions) and e4m3 (converted in
    # software by Triton).
    "h100-fp8-llama-b1-64k": ("h100", Launch("bf16", "fp8", 1, n=65536, **LLAMA)),
    "rtx4090-fp8-llama-b1-64k": ("rtx4090", Launch("bf16", "fp8", 1, n=65536, **LLAMA)),
    "h100-fp8-q-fp16-llama-b64-1split": ("h100", Launch("fp16", "fp8", 64, n=4096, **LLAMA)),
    "rtx4090-fp8-llama-b64-1split": ("rtx4090", Launch("bf16", "fp8", 64, n=4096, **LLAMA)),
    "h100-fp8-q-fp32-llama": ("h100", Launch("fp32", "fp8", 1, n=16384, **LLAMA)),
    "rtx4090-fp8-q-fp32-llama-1split": ("rtx4090", Launch("fp32", "fp8", 64, n=4096, **LLAMA)),
    "h100-fp8-llama-packed": ("h100", Launch("bf16", "fp8", 1, n=16384, packed=True, **LLAMA)),
    "h100-fp8-d64": ("h100", Launch("bf16", "fp8", 2, 16, 2, 64, 8192)),
    "rtx4090-fp8-d80": ("rtx4090", Launch("fp16", "fp8", 2, 32, 32, 80, 4000)),
    "h100-fp8-d256": ("h100", Launch("bf16", "fp8", 1, 8, 8, 256, 8192)),
    "h100-fp8-d128-mqa": ("h100", Launch("bf16", "fp8", 1, 64, 1, 128, 32768)),
    "rtx4090-fp8-d128-mqa": ("rtx4090", Launch("bf16", "fp8", 1, 64, 1, 128, 32768)),
    "h100-fp8-paged16": ("h100", Launch("bf16", "fp8", 4, n=8192, page=16, **LLAMA)),
    "rtx4090-fp8-paged16-1split": ("rtx4090", Launch("fp16", "fp8", 64, n=2048, page=16, **LLAMA)),
    "h100-fp8-paged1": ("h100", Launch("bf16", "fp8", 2, n=2048, page=1, **LLAMA)),
    "rtx4090-fp8-paged17": ("rtx4090", Launch("bf16", "fp8", 2, n=2040, page=17, **LLAMA)),
    "h100-fp8-sq4-causal": ("h100", Launch("bf16", "fp8", 2, sq=4, causal=True, n=8192, **LLAMA)),
    "rtx4090-fp8-sq16-causal-1split": ("rtx4090", Launch("bf16", "fp8", 64, sq=16, causal=True, n=2048, **LLAMA)),
    "h100-fp8-sq8-paged16-causal": ("h100", Launch("bf16", "fp8", 2, sq=8, causal=True, n=8192, page=16, **LLAMA)),
    "h100-fp8-bn128-w8": ("h100", Launch("bf16", "fp8", 1, n=16384, config=cfg(block_n=128, num_warps=8), **LLAMA)),
    "rtx4090-fp8-bn64-s3":
        ("rtx4090", Launch("bf16", "fp8", 1, n=16384, config=cfg(block_n=64, num_stages=3), **LLAMA)),
    "h100-fp8-bn64-s2": ("h100", Launch("bf16", "fp8", 1, n=65536, config=cfg(block_n=64, num_stages=2), **LLAMA)),
    "h100-fp8-bn128-w2-spills":
        ("h100", Launch("bf16", "fp8", 1, n=16384, config=cfg(block_n=128, num_warps=2), **LLAMA)),
    "h100-fp8-q-fp16-g32-bn64-w2-spills":
        ("h100", Launch("fp16", "fp8", 1, 32, 1, 128, 16384, config=cfg(block_n=64, num_warps=2))),
    "mi300x-fp8fnuz-llama-b1-64k": ("mi300x", Launch("bf16", "fp8fnuz", 1, n=65536, **LLAMA)),
    "mi300x-fp8-llama-b1-64k": ("mi300x", Launch("bf16", "fp8", 1, n=65536, **LLAMA)),
    "mi300x-fp8fnuz-sq4-paged16-causal":
        ("mi300x", Launch("fp16", "fp8fnuz", 2, sq=4, causal=True, n=8192, page=16, **LLAMA)),
    # The tree merge (stage two on the stacked messages of a node with 1 and 3 children).
    "h100-tree-merge-2": ("h100", Merge(1, 1, 32, 128)),
    "h100-tree-merge-4-d80": ("h100", Merge(3, 4, 32, 80)),
    "mi300x-tree-merge-2": ("mi300x", Merge(1, 1, 32, 128)),
}

_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn",
           "fp8fnuz": "float8_e4m3fnuz"}


class _TargetDriver:
    """What ``JITFunction.run(warmup=True)`` asks the driver: the target, a device, a stream.

    Each target gets its own device index, because Triton caches a binder (target and backend)
    per device."""

    def __init__(self, target, index: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*target)
        self.index = index

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.index

    def get_current_stream(self, device=None) -> int:
        return 0


def _tensors(launch: Launch):
    """CPU tensors with the call's shapes, dtypes and strides (values are never read)."""
    import torch

    qd, kd = getattr(torch, _DTYPES[launch.q]), getattr(torch, _DTYPES[launch.kv])
    b, hq, hkv, d = launch.b, launch.hq, launch.hkv, launch.d
    q = torch.zeros((b, launch.sq, hq, d) if launch.sq else (b, hq, d), dtype=qd)
    lens = torch.full((b,), launch.n, dtype=torch.int32)
    table = None
    if launch.page:
        blocks = -(-launch.n // launch.page)
        table = torch.zeros(b, blocks, dtype=torch.int32)
        k = torch.empty(b * blocks, launch.page, hkv, d, dtype=kd)
    else:
        k = torch.empty(b, launch.n, hkv, d, dtype=kd)
    scales = None
    if launch.kv.startswith("fp8"):
        scales = (torch.ones(hkv, dtype=torch.float32), torch.ones(hkv, dtype=torch.float32))
    return q, k, torch.empty_like(k), (lens if launch.lens or launch.page else None), table, scales


def plan(target_name: str, launch: Launch):
    """The launcher's plan of this call on the target: ``(TritonDecodeLaunch, launches)``."""
    from tree_attn.cost.devices import KNOWN_DEVICES
    from tree_attn.kernels.config import DecodeConfig
    from tree_attn.kernels.layout import PACKED, OutLayout
    from tree_attn.kernels.triton_launch import TritonDecodeLaunch

    target, spec_name = TARGETS[target_name]
    q, k, v, lens, table, scales = _tensors(launch)
    k_scale, v_scale = scales or (None, None)
    layout = PACKED if launch.packed else OutLayout(q.dtype)
    config = None if launch.config is None else DecodeConfig(**dict(launch.config))
    tl = TritonDecodeLaunch(
        q, k, v, lens, config=config, device_spec=KNOWN_DEVICES[spec_name], out_layout=layout,
        block_table=table, causal=launch.causal, backend=target[0], k_scale=k_scale, v_scale=v_scale,
    )
    out, lse = tl.new_outputs()
    return tl, tl.launches(q, k, v, lens, out, lse, table, k_scale=k_scale, v_scale=v_scale)


def merge_launch(merge: Merge):
    """Stage two as ``TreeMerge`` launches it, on the same views of its packed buffers."""
    import torch

    from tree_attn.kernels.triton_launch import stage2_launch
    from tree_attn.reduce.exchange import tree_merge_views

    states = torch.empty(1 + merge.children, merge.b, merge.hq, merge.d + 1, dtype=torch.float32)
    merged = torch.empty(merge.b, merge.hq, merge.d + 1, dtype=torch.float32)
    o_part, lse_part, out, lse = tree_merge_views(states, merged, merge.d)
    return stage2_launch(o_part, lse_part, out, lse, faulty_is_empty=False)


def _ptxas_facts(log: str) -> dict:
    """Registers and spill-store bytes from Triton's ``ptxas -v`` log of one build."""
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    if len(regs) != 1 or len(spill) != 1:
        return {"ptxas_error": f"expected one function in the ptxas log, got:\n{log[-1500:]}"}
    return {"registers": int(regs[0]), "spill_store_bytes": int(spill[0])}


def compile_facts(kernel, grid, args, kwargs, target) -> dict:
    """Build one launch with ``JITFunction.run(warmup=True)`` and report what it produced."""
    import triton

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # Triton prints ptxas's log (TRITON_DUMP_PTXAS_LOG)
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    if compiled is None:
        raise RuntimeError("JITFunction.run(warmup=True) returned no kernel")
    facts = {"shared": int(compiled.metadata.shared), "hash": compiled.hash, "triton": triton.__version__}
    if target[0] == "cuda":
        ptx = compiled.asm["ptx"]
        facts["scalar_b16_loads"] = bool(re.search(r"ld\.global(\.\w+)*\.(b16|u16)\b", ptx))
        facts["scalar_b8_loads"] = bool(re.search(r"ld\.global(\.\w+)*\.(b8|u8|s8)\b", ptx))
        # One-byte shared-memory reads: an fp8 tile read back element by element (the transposed
        # operand of P @ V when Triton widens it after the read; see triton_decode's FP8_PTX).
        facts["b8_shared_loads"] = len(re.findall(r"ld\.shared(\.\w+)*\.(b8|u8|s8)\b", ptx))
        cp_async_16 = r"cp\.async\.c[ga]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x10|16)\b"
        facts["cp_async_16"] = bool(re.search(cp_async_16, ptx))
        # A build another case already made comes from Triton's caches, without running ptxas.
        if buf.getvalue():
            _PTXAS[compiled.hash] = _ptxas_facts(buf.getvalue())
        facts.update(_PTXAS.get(compiled.hash, {"ptxas_error": "no ptxas log for this build"}))
        facts["ptxas"] = _ptxas_version(target[1])
    else:
        gcn = compiled.asm["amdgcn"]
        # CDNA3's fp8 conversions (its "fnuz" formats) and the vector instructions in all.
        facts["fp8_hw_cvt"] = len(re.findall(r"\bv_cvt_(?:pk_)?f32_fp8", gcn))
        facts["valu"] = len(re.findall(r"^\s+v_", gcn, re.MULTILINE))
    return facts


_PTXAS: dict[str, dict] = {}  # build hash -> its ptxas facts


def _ptxas_version(arch: int) -> str:
    """The release of the ptxas Triton runs for ``arch`` (its bundled one unless TRITON_PTXAS_PATH
    or TRITON_PTXAS_BLACKWELL_PATH names another), e.g. "12.8"."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    try:
        found = re.search(r"Build cuda_(\d+\.\d+)", get_ptxas_version(arch))
    except Exception as exc:  # noqa: BLE001 - a fact for messages, not a check
        return f"unknown ({type(exc).__name__})"
    return found.group(1) if found else "unknown"


def run_case(cid: str, drivers: dict) -> dict:
    from triton.runtime.driver import driver

    target_name, what = CASES[cid]
    target = TARGETS[target_name][0]
    driver.set_active(drivers[target_name])
    try:
        if isinstance(what, Merge):
            return {"stage2": compile_facts(*merge_launch(what), target)}
        tl, launches = plan(target_name, what)
        result = {"config": tl.config.to_dict(), "upcast": tl._stage1_constexprs["UPCAST"]}
        for stage, (kernel, grid, args, kwargs) in zip(("stage1", "stage2"), launches):
            result[stage] = compile_facts(kernel, grid, args, kwargs, target)
        return result
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"[-3000:]}


def main(ids: list[str]) -> None:
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    drivers = {name: _TargetDriver(TARGETS[name][0], i) for i, name in enumerate(TARGETS)}
    print(json.dumps({cid: run_case(cid, drivers) for cid in ids}))


if __name__ == "__main__":
    # Compiled mode, in a Triton cache of its own (a cached build would skip ptxas and its log).
    # Only when run as a script: importing this module for its case table must not change the
    # importing process's Triton mode.
    os.environ.pop("TRITON_INTERPRET", None)
    cache = tempfile.mkdtemp(prefix="tree-attn-aot-")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        main(sys.argv[1:] or list(CASES))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
