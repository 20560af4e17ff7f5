"""The kernel's napkin model: the config space of the split-KV decode kernel, a model of its time,
and the ranking of candidate configs that ``tune`` times.

Decode attention reads the whole KV cache once per step and does little arithmetic per byte, so
its time is, to first order, ``KV bytes / memory bandwidth``. What keeps a config from reaching
that is occupancy: too few programs for the SMs (small batch, few splits) leaves too few loads in
flight to cover DRAM latency (Little's law), wave quantisation leaves the last wave part-empty, and
every split adds a partial state to write and a second kernel to merge them. The model below
prices exactly those effects, so that ``tune`` can rank a few hundred candidates and time only the
few that might win. Its absolute numbers are estimates; only its ordering is relied on, and the
timed survivors decide.

Device constants come from the catalogue (:mod:`tree_attn.cost.devices`: vendor datasheets and
published microbenchmarks, each field says which). Pure Python: no torch at import time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..dtypes import itemsize
from ..kernels.config import (
    HEURISTIC_MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    SMEM_HEADROOM,
    STAGE2_SPLIT_TILE,
    DecodeConfig,
    default_config,
    default_num_splits,
    dot_math,
    group_block,
    group_blocks_for,
    padded_head_dim,
    split_len,
    stage1_smem_bytes,
    stage1_spill_free,
)
from ..validate import check_int, check_number
from .devices import DeviceSpec

if TYPE_CHECKING:  # pragma: no cover - typing only (kernels.shapes imports torch)
    from ..kernels.shapes import DecodeShape



def element_sizes(dtype: Any) -> tuple[int, int]:
    """``(cache bytes, dot operand bytes)`` per element of a ``dtype`` cache: what a decode step
    reads from memory, and what its tiles are once loaded (an fp8 cache is 1 byte in memory and
    widens to fp16 for the dots, see ``kernels.config.dot_math``)."""
    return itemsize(dtype), dot_math(dtype, dtype)[0]


def tile_smem_bytes(
    config: DecodeConfig, shape: DecodeShape, elem: int, kv_elem: int | None = None, *, nvidia: bool = True
) -> int:
    """Shared memory (LDS) of one stage-one program: K and V tiles per pipeline stage (``kv_elem``
    bytes per element, default ``elem``), q and the weights (``elem``); on NVIDIA an fp8 cache's V
    tile once more, widened (see :func:`~tree_attn.kernels.config.stage1_smem_bytes`)."""
    return stage1_smem_bytes(
        config.block_n, config.num_stages, shape.head_dim, elem, group_block(shape.query_rows), kv_bytes=kv_elem,
        nvidia=nvidia,
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
    by_smem = spec.smem_per_sm_bytes // max(1, tile_smem_bytes(config, shape, elem, kv_elem,
                                                               nvidia=spec.vendor != "amd"))
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
    return 2 * shape.batch * shape.kv_len * shape.kv_heads * shape.head_dim * itemsize(dtype)


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
    where the rule passes them) whose pipelined K/V tiles fit in 85% of the SM's shared memory,
    2/4/8 warps (those that do not spill registers, :func:`stage1_spill_free`), 1-4 pipeline
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
            if (tile_smem_bytes(probe, shape, elem, kv_elem, nvidia=not amd)
                    > SMEM_HEADROOM * device_spec.smem_per_sm_bytes):
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
    check_int(top_k, "top_k", positive=True, optional=True, must=True)
    check_number(max_slowdown, "max_slowdown", minimum=1.0, optional=True, must=True)
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
    "Prediction", "RankedConfig", "best_predicted_config", "candidate_configs", "element_sizes", "kv_bytes", "predict",
    "predict_time_us", "rank_candidates", "resident_programs_per_sm", "tuning_survivors",
)
