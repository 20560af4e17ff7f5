"""The config space of the split-KV decode kernel and a napkin model of its time.

Decode attention reads the whole KV cache once per step and does little arithmetic per byte, so
its time is, to first order, ``KV bytes / memory bandwidth``. What keeps a config from reaching
that is occupancy: too few programs for the SMs (small batch, few splits) leaves too few loads in
flight to cover DRAM latency (Little's law), wave quantisation leaves the last wave part-empty, and
every split adds a partial state to write and a second kernel to merge them. The model below
prices exactly those effects, so that ``tune`` can rank a few hundred candidates and time only the
few that might win. Its absolute numbers are estimates; only its ordering is relied on, and the
timed survivors decide.

Device constants come from vendor datasheets (bandwidth, SM counts, cache sizes, tensor peak) and
from published microbenchmarks (DRAM latency, launch gaps); each field says which.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from .. import dtypes as _dtypes
from ..errors import ConfigError
from .config import (
    HEURISTIC_MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    DecodeConfig,
    default_config,
    dot_math,
    default_num_splits,
    group_block,
    group_blocks_for,
    padded_head_dim,
    split_len,
    stage1_smem_bytes,
    stage1_spill_free,
)
from .shapes import DecodeShape

VENDORS = ("nvidia", "amd", "cpu")
BANDWIDTH_SOURCES = ("datasheet", "measured", "assumed")

# Stage two folds this many splits per loop iteration (must match triton_launch.SPLIT_TILE).
STAGE2_SPLIT_TILE = 16
# Fraction of an SM's shared memory a candidate's K/V pipeline may claim (see candidate_configs).
SMEM_HEADROOM = 0.85


@dataclass(frozen=True)
class DeviceSpec:
    """What the napkin model needs to know about one accelerator.

    Attributes:
        name: marketing name (as the driver reports it when read from a device).
        vendor: "nvidia", "amd" or "cpu" (the Triton interpreter).
        sm_count: streaming multiprocessors (NVIDIA) or compute units (AMD).
        mem_bandwidth_gbps: DRAM bandwidth in GB/s (1e9 bytes/s).
        bandwidth_source: "datasheet" (peak, not reachable: copies reach ~90%), "measured" (a
            device-to-device copy on this card) or "assumed" (unknown device: a guess, measure it).
        l2_bytes: last-level on-chip cache (L2; on MI300X the L2 of all XCDs, Infinity Cache not counted).
        smem_per_sm_bytes: shared memory (NVIDIA) or LDS (AMD) per SM/CU.
        max_warps_per_sm: resident warps (wavefronts on AMD) per SM/CU.
        warp_size: 32 on NVIDIA, 64 on AMD CDNA.
        regs_per_sm: 32-bit registers per SM (VGPR file per CU on AMD, in 32-bit lanes).
        mem_latency_ns: loaded DRAM latency, from microbenchmarks (rough).
        tensor_tflops: dense bf16 tensor-core peak with fp32 accumulation (datasheet).
        launch_gap_us: GPU time between back-to-back kernels plus a small kernel's fixed cost.
        per_sm_bandwidth_gbps: DRAM bandwidth one SM/CU can pull on its own (rough; ``None`` =
            twice its fair share, i.e. half the SMs saturate DRAM). This is why a batch-1 decode
            with one program per KV head (8 SMs busy) reaches a small fraction of the card's bandwidth.
    """

    name: str
    vendor: str
    sm_count: int
    mem_bandwidth_gbps: float
    bandwidth_source: str = "datasheet"
    l2_bytes: int = 0
    smem_per_sm_bytes: int = 228 * 1024
    max_warps_per_sm: int = 64
    warp_size: int = 32
    regs_per_sm: int = 65536
    mem_latency_ns: float = 650.0
    tensor_tflops: float = 300.0
    launch_gap_us: float = 2.5
    per_sm_bandwidth_gbps: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"DeviceSpec.name must be a non-empty string; got {self.name!r}")
        if self.vendor not in VENDORS:
            raise ConfigError(f"DeviceSpec.vendor must be one of {', '.join(VENDORS)}; got {self.vendor!r}")
        if self.bandwidth_source not in BANDWIDTH_SOURCES:
            raise ConfigError(
                f"DeviceSpec.bandwidth_source must be one of {', '.join(BANDWIDTH_SOURCES)}; got {self.bandwidth_source!r}"
            )
        for fname in ("sm_count", "max_warps_per_sm", "warp_size", "regs_per_sm", "smem_per_sm_bytes"):
            v = getattr(self, fname)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"DeviceSpec.{fname} must be a positive integer; got {v!r}")
        if isinstance(self.l2_bytes, bool) or not isinstance(self.l2_bytes, int) or self.l2_bytes < 0:
            raise ConfigError(f"DeviceSpec.l2_bytes must be a non-negative integer; got {self.l2_bytes!r}")
        for fname in ("mem_bandwidth_gbps", "mem_latency_ns", "tensor_tflops"):
            v = getattr(self, fname)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0) or math.isinf(v):
                raise ConfigError(f"DeviceSpec.{fname} must be a positive number; got {v!r}")
        if isinstance(self.launch_gap_us, bool) or not isinstance(self.launch_gap_us, (int, float)) or not (
            self.launch_gap_us >= 0
        ):
            raise ConfigError(f"DeviceSpec.launch_gap_us must be >= 0; got {self.launch_gap_us!r}")
        v = self.per_sm_bandwidth_gbps
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0) or math.isinf(v)):
            raise ConfigError(f"DeviceSpec.per_sm_bandwidth_gbps must be a positive number or None; got {v!r}")

    @property
    def sm_bandwidth_gbps(self) -> float:
        """What one SM/CU can stream from DRAM by itself (see ``per_sm_bandwidth_gbps``)."""
        if self.per_sm_bandwidth_gbps is not None:
            return float(self.per_sm_bandwidth_gbps)
        return 2.0 * self.mem_bandwidth_gbps / self.sm_count

    @property
    def achievable_bandwidth_gbps(self) -> float:
        """Bandwidth a perfect streaming kernel reaches: the measured copy rate, or ~90% of a datasheet peak."""
        return self.mem_bandwidth_gbps * (1.0 if self.bandwidth_source == "measured" else 0.9)

    def with_measured_bandwidth(self, gbps: float) -> "DeviceSpec":
        """A copy whose bandwidth is ``gbps`` measured on this card (e.g. by a device-to-device copy)."""
        return replace(self, mem_bandwidth_gbps=float(gbps), bandwidth_source="measured")

    @classmethod
    def from_torch_device(cls, device: Any = None) -> "DeviceSpec":
        """Spec of a torch device: a known card's datasheet numbers, with the SM count and L2 size
        the driver reports; for an unknown card, what the driver reports and assumed latencies.

        ``device``: a ``torch.device``, an index, a string such as ``"cuda:1"``, or ``None`` for the
        current CUDA/ROCm device. A CPU device gives :data:`CPU_INTERPRETER`.
        """
        import torch

        dev = torch.device(device) if device is not None and not isinstance(device, int) else None
        if dev is not None and dev.type != "cuda":
            return CPU_INTERPRETER
        if not torch.cuda.is_available():
            return CPU_INTERPRETER
        index = device if isinstance(device, int) else (dev.index if dev is not None and dev.index is not None else torch.cuda.current_device())
        props = torch.cuda.get_device_properties(index)
        name = str(props.name)
        amd = getattr(torch.version, "hip", None) is not None
        sm = int(props.multi_processor_count)
        l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        known = lookup_known_device(name, getattr(props, "gcnArchName", ""))
        if known is not None:
            spec = replace(known, name=name, sm_count=sm)
            if l2 > 0 and not amd:
                # On ROCm the reported L2 is one XCD's; keep the datasheet total there.
                spec = replace(spec, l2_bytes=l2)
            return spec
        # Unknown card: DRAM bandwidth from clock x bus width if torch exposes them, else a guess.
        clock_khz = getattr(props, "memory_clock_rate", 0) or 0
        bus_bits = getattr(props, "memory_bus_width", 0) or 0
        if clock_khz and bus_bits:
            gbps = 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
            source = "datasheet"
        else:
            gbps = 1000.0
            source = "assumed"
        warp = int(getattr(props, "warp_size", 64 if amd else 32) or (64 if amd else 32))
        max_threads = int(getattr(props, "max_threads_per_multi_processor", 2048) or 2048)
        return cls(
            name=name,
            vendor="amd" if amd else "nvidia",
            sm_count=sm,
            mem_bandwidth_gbps=gbps,
            bandwidth_source=source,
            l2_bytes=l2,
            smem_per_sm_bytes=int(getattr(props, "shared_memory_per_multiprocessor", 0) or (64 * 1024 if amd else 100 * 1024)),
            max_warps_per_sm=max(1, max_threads // warp),
            warp_size=warp,
            regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 0) or 65536),
            mem_latency_ns=800.0 if amd else 650.0,
            tensor_tflops=300.0,
            launch_gap_us=4.0 if amd else 2.5,
        )


MiB = 1024 * 1024
KiB = 1024

# Datasheet numbers (bandwidth, SMs, L2, shared memory, dense bf16 tensor peak). DRAM latencies are
# rounded figures from microbenchmark papers (Hopper/Ampere ~500-700 ns loaded, GDDR6X similar,
# MI300X ~800+ ns); launch gaps are typical back-to-back gaps seen in profiles; per-SM bandwidths
# are order-of-magnitude figures (one SM's load path and outstanding-miss limits let it stream a
# few tens of GB/s, so roughly half the SMs must be busy to saturate HBM). All "rough".
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec(
        name="NVIDIA H100 SXM5 80GB", vendor="nvidia", sm_count=132, mem_bandwidth_gbps=3350.0,
        l2_bytes=50 * MiB, smem_per_sm_bytes=228 * KiB, max_warps_per_sm=64, tensor_tflops=989.0,
        mem_latency_ns=650.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=55.0,
    ),
    "h100-pcie": DeviceSpec(
        name="NVIDIA H100 PCIe 80GB", vendor="nvidia", sm_count=114, mem_bandwidth_gbps=2000.0,
        l2_bytes=50 * MiB, smem_per_sm_bytes=228 * KiB, max_warps_per_sm=64, tensor_tflops=756.0,
        mem_latency_ns=650.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=40.0,
    ),
    "h100-nvl": DeviceSpec(
        name="NVIDIA H100 NVL 94GB", vendor="nvidia", sm_count=132, mem_bandwidth_gbps=3900.0,
        l2_bytes=50 * MiB, smem_per_sm_bytes=228 * KiB, max_warps_per_sm=64, tensor_tflops=835.0,
        mem_latency_ns=650.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=60.0,
    ),
    "h200": DeviceSpec(
        name="NVIDIA H200 SXM 141GB", vendor="nvidia", sm_count=132, mem_bandwidth_gbps=4800.0,
        l2_bytes=50 * MiB, smem_per_sm_bytes=228 * KiB, max_warps_per_sm=64, tensor_tflops=989.0,
        mem_latency_ns=650.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=60.0,
    ),
    "rtx4090": DeviceSpec(
        name="NVIDIA GeForce RTX 4090", vendor="nvidia", sm_count=128, mem_bandwidth_gbps=1008.0,
        l2_bytes=72 * MiB, smem_per_sm_bytes=100 * KiB, max_warps_per_sm=48, tensor_tflops=165.0,
        mem_latency_ns=550.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=40.0,
    ),
    "a100-sxm-80gb": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB", vendor="nvidia", sm_count=108, mem_bandwidth_gbps=2039.0,
        l2_bytes=40 * MiB, smem_per_sm_bytes=164 * KiB, max_warps_per_sm=64, tensor_tflops=312.0,
        mem_latency_ns=600.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=40.0,
    ),
    "a100-40gb": DeviceSpec(
        name="NVIDIA A100-SXM4-40GB", vendor="nvidia", sm_count=108, mem_bandwidth_gbps=1555.0,
        l2_bytes=40 * MiB, smem_per_sm_bytes=164 * KiB, max_warps_per_sm=64, tensor_tflops=312.0,
        mem_latency_ns=600.0, launch_gap_us=2.5, per_sm_bandwidth_gbps=35.0,
    ),
    "mi300x": DeviceSpec(
        name="AMD Instinct MI300X", vendor="amd", sm_count=304, mem_bandwidth_gbps=5300.0,
        l2_bytes=32 * MiB, smem_per_sm_bytes=64 * KiB, max_warps_per_sm=32, warp_size=64,
        regs_per_sm=4 * 512 * 64, tensor_tflops=1307.0, mem_latency_ns=850.0, launch_gap_us=4.0, per_sm_bandwidth_gbps=35.0,
    ),
}

# The Triton interpreter on CPU: only so that heuristics produce small, valid grids in tests.
CPU_INTERPRETER = DeviceSpec(
    name="cpu (Triton interpreter)", vendor="cpu", sm_count=max(1, os.cpu_count() or 1),
    mem_bandwidth_gbps=20.0, bandwidth_source="assumed", l2_bytes=0, smem_per_sm_bytes=1 << 20,
    max_warps_per_sm=64, mem_latency_ns=100.0, tensor_tflops=0.1, launch_gap_us=50.0,
)


def lookup_known_device(name: str, arch: str = "") -> DeviceSpec | None:
    """The datasheet spec whose card the driver's ``name`` (and AMD ``gcnArchName``) denotes, or None."""
    n = name.lower()
    if "h200" in n:
        return KNOWN_DEVICES["h200"]
    if "h100" in n:
        if "pcie" in n:
            return KNOWN_DEVICES["h100-pcie"]
        if "nvl" in n:
            return KNOWN_DEVICES["h100-nvl"]
        return KNOWN_DEVICES["h100-sxm"]
    if "4090" in n:
        return KNOWN_DEVICES["rtx4090"]
    if "a100" in n:
        return KNOWN_DEVICES["a100-40gb"] if "40gb" in n else KNOWN_DEVICES["a100-sxm-80gb"]
    if "mi300x" in n or ("gfx942" in (arch or "").lower() and "mi300a" not in n and "mi325" not in n):
        return KNOWN_DEVICES["mi300x"]
    return None


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a name ("bf16", "float16", "fp32", ...)."""
    name = _dtypes.canonical(dtype)
    if name is None:
        raise ConfigError(f"unsupported dtype {dtype!r}; use float16, bfloat16 or float32")
    return _dtypes.ITEMSIZE[name]


def element_sizes(dtype: Any) -> tuple[int, int]:
    """``(cache bytes, dot operand bytes)`` per element of a ``dtype`` cache: what a decode step
    reads from memory, and what its tiles are once loaded (an fp8 cache is 1 byte in memory and
    widens to fp16 for the dots, see ``kernels.config.dot_math``)."""
    return dtype_bytes(dtype), dot_math(dtype, dtype)[0]


def tile_smem_bytes(config: DecodeConfig, shape: DecodeShape, elem: int, kv_elem: int | None = None) -> int:
    """Shared memory (LDS) of one stage-one program: K and V tiles per pipeline stage (``kv_elem``
    bytes per element, default ``elem``), q and the weights (``elem``)."""
    return stage1_smem_bytes(
        config.block_n, config.num_stages, shape.head_dim, elem, group_block(shape.query_rows), kv_bytes=kv_elem
    )


def resident_programs_per_sm(
    config: DecodeConfig, shape: DecodeShape, elem: int, spec: DeviceSpec, kv_elem: int | None = None
) -> int:
    """Stage-one programs one SM/CU holds at once: min over warps, shared memory, registers
    (``elem``: the dots' operand bytes; ``kv_elem``: the cache's, if it differs)."""
    by_warps = spec.max_warps_per_sm // config.num_warps
    if spec.vendor == "amd" and config.waves_per_eu:
        # waves_per_eu caps waves per SIMD; a CDNA CU has 4 SIMDs.
        by_warps = min(by_warps, (4 * config.waves_per_eu) // config.num_warps)
    by_smem = spec.smem_per_sm_bytes // max(1, tile_smem_bytes(config, shape, elem, kv_elem))
    threads = config.num_warps * spec.warp_size
    d = padded_head_dim(shape.head_dim)
    g = group_block(shape.query_rows)
    # fp32 accumulator [g, d], scores [g, block_n], and a register-staged K/V tile, spread over the
    # threads, plus addresses and loop state; x1.25 and +48 fit what ptxas reports for Triton 3.9
    # sm_90 bf16 builds (D=128, 4 warps: block_n 32 / 64 / 128 -> 82 / 128 / 176 registers; group 32
    # -> 168; D=256 block_n 32 -> 136). Capped at the 255 a thread can have (beyond: spills).
    regs_per_thread = min(255, int(48 + 1.25 * (g * d + g * config.block_n + config.block_n * d * elem // 4) / threads))
    by_regs = spec.regs_per_sm // max(1, regs_per_thread * threads)
    return max(1, min(by_warps, by_smem, by_regs, 32))


@dataclass(frozen=True)
class Prediction:
    """The model's estimate for one config on one shape (times in microseconds)."""

    total_us: float
    stage1_us: float
    stage2_us: float
    launch_us: float
    kv_bytes: int
    bytes_moved: int
    programs: int
    slots: int
    waves: float
    achieved_gbps: float
    bound: str  # "memory", "latency" (too little in flight), "compute" or "launch"


def kv_bytes(shape: DecodeShape, dtype: Any) -> int:
    """Bytes of K and V one decode step reads (all N positions of every row: the padded worst case)."""
    return 2 * shape.batch * shape.kv_len * shape.kv_heads * shape.head_dim * dtype_bytes(dtype)


def predict(config: DecodeConfig, shape: DecodeShape, dtype: Any, spec: DeviceSpec) -> Prediction:
    """Napkin estimate of one launch of the two-stage kernel; see the module docstring."""
    if config.num_splits is None:
        config = config.with_splits(
            default_num_splits(
                shape.batch, shape.kv_heads, shape.kv_len, config.block_n, spec.sm_count,
                group_blocks=group_blocks_for(shape.query_rows),
            )
        )
    # K/V bytes in memory; the dots' operand bytes (those of q and of a 16-bit out, too).
    kv_elem, elem = element_sizes(dtype)
    b, hq, hkv, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    splits = config.num_splits
    gb = group_blocks_for(shape.query_rows)
    if b == 0 or hq == 0 or n == 0:
        # The launcher answers these without a kernel; a nominal launch gap keeps ordering sane.
        return Prediction(spec.launch_gap_us, 0.0, 0.0, spec.launch_gap_us, 0, 0, 0, 0, 0.0, 0.0, "launch")

    programs = b * hkv * gb * splits
    resident = resident_programs_per_sm(config, shape, elem, spec, kv_elem)
    slots = spec.sm_count * resident
    waves = programs / slots
    full_waves = math.ceil(waves)

    s_len = split_len(n, splits, config.block_n)
    tiles_per_prog = math.ceil(s_len / config.block_n)
    # Splits past the end of the sequence are empty; count the bytes actually read.
    kv = kv_bytes(shape, dtype)
    q_bytes = b * hq * d * elem * splits  # every split reloads q (tiny, served from L2 mostly)
    partial_bytes = b * hq * splits * (d + 1) * 4 if splits > 1 else b * hq * (d * elem + 4)
    stage1_bytes = kv + q_bytes + partial_bytes
    bytes_per_prog = stage1_bytes / programs

    peak = spec.achievable_bandwidth_gbps * 1e3  # bytes per microsecond
    # Little's law: what the resident programs keep in flight. A pipeline of S stages has S-1 future
    # K/V tiles loading while one is consumed; without pipelining the K and V loads of a tile are
    # issued one after the other around the dot, about half a tile pair in flight on average.
    depth = 0.5 if config.num_stages <= 1 else config.num_stages - 1
    inflight_per_prog = 2 * config.block_n * d * kv_elem * depth
    latency_us = spec.mem_latency_ns * 1e-3

    sm_bw = spec.sm_bandwidth_gbps * 1e3

    def bandwidth(concurrent: int) -> float:
        busy_sms = min(concurrent, spec.sm_count)
        return min(peak, concurrent * inflight_per_prog / latency_us, busy_sms * sm_bw)

    # Memory time in rounds: full waves of `slots` programs stream at the bandwidth that many
    # programs sustain; the leftover programs of the last round stream at what *they* sustain (a
    # few programs alone on the machine are capped by the per-SM bandwidth: the tail effect).
    rounds_full = programs // slots
    leftover = programs - rounds_full * slots
    t_mem = 0.0
    if rounds_full:
        t_mem += rounds_full * slots * bytes_per_prog / bandwidth(slots)
    if leftover:
        t_mem += leftover * bytes_per_prog / bandwidth(leftover)
    bw = stage1_bytes / t_mem

    # Compute: two [g, block_n, d] dots per tile on the SM's share of the tensor peak, plus the
    # exp/max/sum of the online softmax (~4 cycles per score element per warp-instruction batch).
    g_pad = group_block(shape.query_rows)
    per_sm_flops_us = spec.tensor_tflops * 1e6 / spec.sm_count  # flops per microsecond per SM
    tile_flops = 4 * g_pad * config.block_n * padded_head_dim(d)
    tile_us = tile_flops / per_sm_flops_us + (g_pad * config.block_n) / (spec.warp_size * 4 * 1.5e3)
    progs_per_sm = math.ceil(programs / spec.sm_count)
    t_compute = progs_per_sm * tiles_per_prog * tile_us
    # Dependent chain of one program: q load, first tile, store (~3 latencies) plus per-tile work.
    t_chain = full_waves * (3 * latency_us + tiles_per_prog * tile_us)
    stage1 = max(t_mem, t_compute, t_chain)

    stage2 = 0.0
    launches = 1
    moved = stage1_bytes
    if splits > 1:
        launches = 2
        s2_bytes = b * hq * splits * (d + 1) * 4 + b * hq * (d * elem + 4)
        moved += s2_bytes
        # Reads of the partials mostly hit L2 (just written); price them at peak DRAM rate anyway,
        # plus a latency per pass over the splits (max pass, then the weighted-sum pass).
        passes = 2 * math.ceil(splits / STAGE2_SPLIT_TILE)
        stage2 = s2_bytes / peak + (2 + passes) * latency_us
    launch = launches * spec.launch_gap_us
    total = stage1 + stage2 + launch

    if stage1 == t_mem:
        bound = "memory" if bw >= 0.999 * peak else "latency"
    elif stage1 == t_compute:
        bound = "compute"
    else:
        bound = "latency"
    if launch > stage1 + stage2:
        bound = "launch"
    return Prediction(
        total_us=total,
        stage1_us=stage1,
        stage2_us=stage2,
        launch_us=launch,
        kv_bytes=kv,
        bytes_moved=int(moved),
        programs=programs,
        slots=slots,
        waves=waves,
        achieved_gbps=kv / total / 1e3,
        bound=bound,
    )


def predict_time_us(config: DecodeConfig, shape: DecodeShape, dtype: Any, device_spec: DeviceSpec) -> float:
    """Predicted GPU time in microseconds of one decode-attention launch (both stages)."""
    return predict(config, shape, dtype, device_spec).total_us


def _split_options(shape: DecodeShape, block_n: int, spec: DeviceSpec) -> list[int]:
    tiles = max(1, math.ceil(shape.kv_len / block_n))
    cap = max(1, min(HEURISTIC_MAX_SPLITS * 2, tiles))
    opts = {1}
    s = 2
    while s <= cap:
        opts.add(s)
        s *= 2
    opts.add(
        default_num_splits(
            shape.batch, shape.kv_heads, shape.kv_len, block_n, spec.sm_count,
            group_blocks=group_blocks_for(shape.query_rows),
        )
    )
    # Splits shorter than a couple of tiles only add partial-state traffic: drop them except 1.
    return sorted(x for x in opts if x == 1 or tiles // x >= max(1, MIN_TILES_PER_SPLIT // 2))


def candidate_configs(shape: DecodeShape, dtype: Any, device_spec: DeviceSpec) -> list[DecodeConfig]:
    """The tuning search space for one shape on one device: every config with an explicit
    ``num_splits`` (powers of two up to the tile count, plus the heuristic's pick), block_n in
    {32, 64, 128} ({16, 32, 64} for fp32; fp8 as 16-bit: 256-key tiles, tried, spill registers
    where the rule passes them) whose pipelined K/V tiles fit in 85% of the SM's shared memory, 2/4/8 warps (those that do not spill registers, :func:`stage1_spill_free`), 1-4 pipeline
    stages on NVIDIA and 1-2 with waves_per_eu in {0, 1, 2, 4} on AMD.
    """
    kv_elem, elem = element_sizes(dtype)
    amd = device_spec.vendor == "amd"
    stage_opts = (1, 2) if amd else (1, 2, 3, 4)
    wpe_opts: tuple[int | None, ...] = (0, 1, 2, 4) if amd else (None,)
    out: list[DecodeConfig] = []
    for block_n in (16, 32, 64) if elem == 4 else (32, 64, 128):
        split_opts = _split_options(shape, block_n, device_spec)
        for num_stages in stage_opts:
            probe = DecodeConfig(block_n=block_n, num_warps=4, num_stages=num_stages)
            # 15% headroom: Triton also stages layout conversions and the P tile in shared memory.
            if tile_smem_bytes(probe, shape, elem, kv_elem) > SMEM_HEADROOM * device_spec.smem_per_sm_bytes:
                continue
            for num_warps in (2, 4, 8):
                if not stage1_spill_free(block_n, num_warps, shape, dtype, device_spec.warp_size):
                    continue
                for wpe in wpe_opts:
                    for splits in split_opts:
                        out.append(
                            DecodeConfig(
                                block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                num_splits=splits, waves_per_eu=wpe,
                            )
                        )
    return out


@dataclass(frozen=True)
class RankedConfig:
    """A candidate with its predicted time."""

    config: DecodeConfig
    predicted_us: float


def rank_candidates(
    configs: Iterable[DecodeConfig],
    shape: DecodeShape,
    dtype: Any,
    device_spec: DeviceSpec,
    *,
    top_k: int | None = None,
    max_slowdown: float | None = None,
) -> list[RankedConfig]:
    """Sort ``configs`` by predicted time (fastest first, ties in a stable config order) and prune.

    Args:
        top_k: keep at most this many.
        max_slowdown: drop those predicted slower than ``max_slowdown`` x the best (e.g. 1.5).
    """
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"top_k must be a positive integer or None; got {top_k!r}")
    if max_slowdown is not None and not (max_slowdown >= 1.0):
        raise ConfigError(f"max_slowdown must be >= 1.0 or None; got {max_slowdown!r}")
    ranked = [RankedConfig(c, predict_time_us(c, shape, dtype, device_spec)) for c in configs]
    ranked.sort(
        key=lambda r: (
            r.predicted_us,
            r.config.num_splits or 0,
            r.config.block_n,
            r.config.num_warps,
            r.config.num_stages,
            r.config.waves_per_eu or 0,
        )
    )
    if ranked and max_slowdown is not None:
        limit = ranked[0].predicted_us * max_slowdown
        ranked = [r for r in ranked if r.predicted_us <= limit]
    if top_k is not None:
        ranked = ranked[:top_k]
    return ranked


def tuning_survivors(
    ranked: list[RankedConfig], k: int, include: RankedConfig | None = None, *, max_slowdown: float = 1.5
) -> list[RankedConfig]:
    """The ``k`` configs ``tune`` times, from ``ranked`` (the model's order): ``include`` (the
    launch heuristic's default, what runs without a profile, so tuning can keep it), then the
    model's best config of each split count in turn, round robin, over the split counts whose best
    is predicted within ``max_slowdown`` x the overall best. Returned in the model's order.

    The model's time saturates once enough programs stream: dozens of configs tie for first place,
    all with one split count, so a plain top-k would time warps and stages only and let the
    model alone decide the split count, the choice that matters most on the device.
    """
    by_splits: dict[int, list[RankedConfig]] = {}
    limit = ranked[0].predicted_us * max_slowdown if ranked else 0.0
    for r in ranked:  # groups in the order of their best prediction; each group in model order
        splits = r.config.num_splits or 0
        if splits in by_splits or r.predicted_us <= limit:
            by_splits.setdefault(splits, []).append(r)
    chosen: list[RankedConfig] = []
    taken: dict[int, int] = {}  # configs chosen per split count

    def take(r: RankedConfig) -> None:
        chosen.append(r)
        taken[r.config.num_splits or 0] = taken.get(r.config.num_splits or 0, 0) + 1

    if include is not None:
        take(include)
    rest = {splits: [r for r in group if include is None or r.config != include.config]
            for splits, group in by_splits.items()}
    depth = 0
    while len(chosen) < k and any(rest.values()):
        depth += 1  # each pass gives every split count up to `depth` configs
        for splits, group in rest.items():
            if len(chosen) < k and group and taken.get(splits, 0) < depth:
                take(group.pop(0))
    order = {r.config: i for i, r in enumerate(ranked)}
    return sorted(chosen, key=lambda r: (r.predicted_us, order.get(r.config, len(order))))


def best_predicted_config(shape: DecodeShape, dtype: Any, device_spec: DeviceSpec) -> DecodeConfig:
    """The model's favourite among :func:`candidate_configs` (the default heuristic is used at
    launch instead; this is for comparing the two)."""
    ranked = rank_candidates(candidate_configs(shape, dtype, device_spec), shape, dtype, device_spec, top_k=1)
    return ranked[0].config if ranked else default_config(shape, dtype, device_spec)


__all__: Sequence[str] = (
    "DeviceSpec",
    "KNOWN_DEVICES",
    "tuning_survivors",
    "CPU_INTERPRETER",
    "Prediction",
    "RankedConfig",
    "candidate_configs",
    "dtype_bytes",
    "element_sizes",
    "kv_bytes",
    "lookup_known_device",
    "predict",
    "predict_time_us",
    "rank_candidates",
    "resident_programs_per_sm",
    "best_predicted_config",
)
