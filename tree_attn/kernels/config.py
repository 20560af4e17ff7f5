"""Explicit launch configurations of the Triton split-KV decode kernel, and the default heuristic.

Configs are plain data, chosen before launch: there is no ``@triton.autotune`` anywhere, because in
a multi-GPU decode every rank must run the same config (ranks that each benchmark at run time can
pick different winners, and timing noise then turns into run-to-run differences in rounding).
``tune`` searches :func:`tree_attn.cost.kernel.candidate_configs` once and writes the winner
into a profile; without one, :func:`default_config` picks a config from the shape and the device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from .. import validate
from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ..cost.devices import DeviceSpec
    from .shapes import DecodeShape

# tl.dot needs every block dimension >= 16; above 512 keys per tile the K and V tiles of one
# program no longer fit the shared memory of any current GPU once pipelined.
MIN_BLOCK_N = 16
MAX_BLOCK_N = 512
# Triton accepts 1..32 warps per program; more than 16 never helps a [16, BLOCK_N] x [BLOCK_N, D] dot.
MAX_NUM_WARPS = 16
MAX_NUM_STAGES = 8
# Stage two keeps one [splits] vector of lse per (row, head) and loops over the partials, so any
# count works; past a few hundred splits the partial outputs cost more bandwidth than they save.
MAX_NUM_SPLITS = 1024
# AMD's waves_per_eu hint: 0 lets the compiler choose; a CDNA3 SIMD holds at most 8 waves.
MAX_WAVES_PER_EU = 8

# Heuristic knobs (see default_num_splits): without splitting, batch x KV heads programs that
# already cover this fraction of the SMs are left alone (the rule FlashAttention-2's split heuristic
# uses); otherwise aim for this many programs per SM so that enough SMs stream at once, never make
# a split shorter than this many tiles (a split pays a prologue, a q load and a partial-state
# write), and cap the count.
FULL_MACHINE_FRACTION = 0.8
TARGET_PROGRAMS_PER_SM = 2
MIN_TILES_PER_SPLIT = 4
HEURISTIC_MAX_SPLITS = 128

# Stage two folds this many splits per loop iteration (the launcher's SPLIT_TILE; the cost model
# prices stage two's passes over the splits with it).
STAGE2_SPLIT_TILE = 16
# The fraction of an SM's shared memory a config's pipelined K/V tiles may claim (the default
# config and the tuning candidates): Triton also stages layout conversions and the P tile there.
SMEM_HEADROOM = 0.85


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _check_int(name: str, value: Any, lo: int, hi: int, *, pow2: bool = False, optional: bool = False) -> None:
    validate.check_int(value, f"DecodeConfig.{name}", minimum=lo, maximum=hi, optional=optional, must=True)
    if pow2 and value is not None and not _is_pow2(value):
        raise ConfigError(f"DecodeConfig.{name} must be a power of two; got {value}")


@dataclass(frozen=True)
class DecodeConfig:
    """One launch configuration of the split-KV decode kernel.

    Attributes:
        block_n: keys per tile of the inner loop (power of two, 16..512).
        num_warps: warps per program of stage one (power of two, 1..16).
        num_stages: software-pipelining depth of the tile loop (1..8; 1 = no pipelining).
        num_splits: KV splits per (batch row, KV head), 1..1024; ``None`` = heuristic at launch.
        waves_per_eu: AMD occupancy hint (0..8, 0 = compiler's choice); must be ``None`` elsewhere.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None
    waves_per_eu: int | None = None

    def __post_init__(self) -> None:
        _check_int("block_n", self.block_n, MIN_BLOCK_N, MAX_BLOCK_N, pow2=True)
        _check_int("num_warps", self.num_warps, 1, MAX_NUM_WARPS, pow2=True)
        _check_int("num_stages", self.num_stages, 1, MAX_NUM_STAGES)
        _check_int("num_splits", self.num_splits, 1, MAX_NUM_SPLITS, optional=True)
        _check_int("waves_per_eu", self.waves_per_eu, 0, MAX_WAVES_PER_EU, optional=True)
        # Configs key the prepared-launch cache on every eager call: hash the fields once.
        object.__setattr__(self, "_hash", hash((self.block_n, self.num_warps, self.num_stages, self.num_splits,
                                                self.waves_per_eu)))

    def __hash__(self) -> int:
        return self._hash

    def to_dict(self) -> dict[str, int | None]:
        """Plain dict in field order (stable for YAML/JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecodeConfig:
        """Build from a mapping such as a profile's ``kernel:`` section; unknown keys are rejected.

        Missing keys take the dataclass defaults.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a DecodeConfig must be a mapping; got {type(data).__name__}: {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown DecodeConfig key(s) {', '.join(unknown)}; allowed: {', '.join(f.name for f in fields(cls))}"
            )
        return cls(**dict(data))

    def with_splits(self, num_splits: int) -> DecodeConfig:
        """A copy with ``num_splits`` set."""
        return replace(self, num_splits=num_splits)

    def describe(self) -> str:
        """Short human-readable form, e.g. ``bn64 w4 s2 splits=16``."""
        s = f"bn{self.block_n} w{self.num_warps} s{self.num_stages} splits={self.num_splits or 'auto'}"
        if self.waves_per_eu is not None:
            s += f" wpe{self.waves_per_eu}"
        return s


def dot_math(q_dtype: Any, kv_dtype: Any) -> tuple[int, int]:
    """How stage one's dots compute for a query of ``q_dtype`` over a cache of ``kv_dtype`` (torch
    dtypes or names): ``(operand bytes, parts)``.

    - one dtype: ``(2, 1)`` fp16/bf16 tensor-core dots, ``(4, 1)`` fp32 dots;
    - a 16-bit cache with another query dtype: ``(2, parts)``: tensor-core dots in the cache's
      dtype, q and the softmax weights entering them as the sum of ``parts`` values of that dtype
      (see ``triton_decode``): over bf16, 2 for an fp16 query (exact) and 3 for fp32 (fp32's
      precision); over fp16, 1 for a bf16 query (exact, after a power-of-two prescale into fp16's
      range) and 3 for fp32;
    - an fp32 cache: ``(4, 1)``, the query is converted to fp32;
    - an fp8 cache: as an fp16 cache, to which its tiles widen exactly (see ``triton_decode``).
    """
    from .. import dtypes as _dtypes  # local: keeps this module free of imports at load time

    q, kv = _dtypes.parse_kv_dtype(q_dtype), _dtypes.parse_kv_dtype(kv_dtype)
    if kv in _dtypes.FP8:
        kv = "float16"  # the tiles widen to fp16 (exactly)
    if q in _dtypes.FP8:  # element_sizes(fp8) asks with the cache's dtype for both
        q = "float16"
    if q == kv or kv == "float32":
        return _dtypes.ITEMSIZE[kv], 1
    if q == "float32":
        return 2, 3
    return 2, 2 if kv == "bfloat16" else 1


def padded_head_dim(head_dim: int) -> int:
    """The kernel's ``BLOCK_D``: the head dim rounded up to a power of two, at least 16 (tl.dot)."""
    return 1 << max(4, (max(1, head_dim) - 1).bit_length())


def stage1_smem_bytes(
    block_n: int, num_stages: int, head_dim: int, elem_bytes: int, group_rows: int = 16, dot_parts: int = 1,
    kv_bytes: int | None = None, *, nvidia: bool = True,
) -> int:
    """Shared memory (LDS) one stage-one program needs: an upper bound over the two ways Triton
    3.9 lowers the kernel's dots, fitted exactly to what it allocates for sm_80/89/90.

    - ``mma`` (every GPU; Hopper below 64 query rows): the software pipeline keeps
      ``num_stages - 1`` K and V tile pairs in flight (cp.async), an unpipelined loop stages one
      tile at a time; the ``[group_rows, D]`` query and ``[group_rows, block_n]`` weight tiles are
      staged too, once per part of a mixed-dtype launch (:func:`dot_math`). (sm_90 bf16 D=128,
      16 rows, block_n 64, 1 / 2 / 3 stages: 22 / 38 / 70 KiB; with an fp16 / fp32 query over
      bf16, 2 stages: 44 / 50 KiB.)
    - ``wgmma`` (Hopper, 16-bit, >= 64 rows, i.e. MQA-like groups): every stage holds a K/V pair
      and the query tile (each of its parts); the weights stay in registers, unless they come in
      parts. (64 rows, D=128, block_n 128, 3 stages: 208 KiB; 16 keys, 2 stages, 2 parts: 52 KiB.)

    ``group_rows`` is the padded query-head rows per program (:func:`group_block`); ``elem_bytes``
    the dots' operand size, ``kv_bytes`` the cache's element size if it differs: an fp8 cache's
    tiles are staged as fp8, and on NVIDIA GPUs (``nvidia``) the V tile once more widened to fp16
    (``mma``: it is read back transposed by ``ldmatrix``, see ``triton_decode``): sm_89/90, D=128,
    16 rows, block_n 64, 2 / 3 stages: 38 / 54 KiB (22 / 38 KiB without that second staging). Plus
    1 KiB for reduction scratch (fp32 builds use 256 B). CDNA3 builds (``nvidia=False``) stay below
    the ``mma`` figure.
    """
    d = padded_head_dim(head_dim)
    kv_tile = block_n * d * (elem_bytes if kv_bytes is None else kv_bytes)
    q_tile = group_rows * d * elem_bytes
    p_tile = group_rows * block_n * elem_bytes
    kv = (num_stages - 1) * 2 * kv_tile if num_stages > 1 else kv_tile
    mma = kv + dot_parts * (q_tile + p_tile)
    if nvidia and kv_bytes is not None and kv_bytes < elem_bytes:
        mma += block_n * d * elem_bytes  # the widened V tile
    wgmma = 0
    if group_rows >= 64 and elem_bytes == 2:
        wgmma = num_stages * 2 * kv_tile + dot_parts * q_tile + (dot_parts * p_tile if dot_parts > 1 else 0)
    return max(mma, wgmma) + 1024


# Registers. ptxas -v on the builds of real launches puts the spill boundary of a stage-one
# program, in per-thread counts (threads = warps x warp size) of its accumulator ``acc = rows x D``,
# its K/V tile ``kv = block_n x D`` and its scores ``s = rows x block_n``, where the bounds of a
# :class:`SpillProfile` say. Where the boundary lies depends on the compiler: Triton's code
# generation and the ptxas it runs (its bundled one). The bounds of Triton 3.9 (ptxas 12.9 for sm_89,
# 13.4 for sm_90; fitted to 972 builds, sm_89 and sm_90, in benchmarks/RESULTS.md):
# - fp16/bf16 (tensor-core dots): ``acc / 2 + kv + s < 160``. A mixed-dtype launch's query and
#   weights in 2 or 3 parts (dot_math; fitted over bf16 caches) add ``1.5 acc + 2 s``; one part (a
#   bf16 query over fp16) and a per-key paged gather add nothing. No build the rule passes spills;
#   it also prunes some that fill all 255 registers without spilling (D=128, 64 keys, 2 warps: 255
#   registers on sm_89, 4 B spilled on sm_90).
# - fp8 caches (tiles widened to fp16, the dots as for an fp16 cache): the same counts below 144,
#   not 160. First fitted to 648 builds when V was widened after its shared-memory read, its fp8
#   bytes and fp16 values live together (D=128, 64 keys, 4 warps, 2 stages: 176 registers). Refitted
#   since V's widening stays in place (see triton_decode; the same build: 122 registers) to the 192
#   builds within 0.7-1.4x of 160 per thread (sm_89 and sm_90; D 64/128/256; 16/32/64 rows; 32-128
#   keys; 2/4/8 warps; fp16, bf16 and fp32 queries; contiguous and gathered): below 144 one build
#   spills, an fp32 query's (D=64, 32 rows, 64 keys, 4 warps: 12 B at 128 registers on sm_90, a
#   ptxas choice no count predicts); below 160 three would, so the bound stays, conservative (D=128,
#   16 rows, 128 keys, 4 warps: 152 per thread, 174 registers and no spill, is pruned).
# - fp32 (FMA dots, in IEEE fp32): ptxas's register use is not monotonic in these counts (32 rows,
#   D=64, 32 keys: 88 registers with 4 warps, 170 with 8), and what bounds it is the dots' multiply-
#   adds per thread and tile, ``rows x block_n x D / threads``: the contiguous builds at <= 512 keep
#   their registers (but one, below), at 1,024 more than half spill (D=128, 16 rows, 64 keys, 2
#   warps: 15 KB). A per-key paged gather below 16 warps halves the bound (16 rows, D=128, 32
#   keys, 4 warps: 524 B gathered, 107 registers contiguous; 64 rows, D=128, 16 keys, 8 warps: 568
#   B, a default's build, though the fit had every gathered 8-warp build at 512 keep its registers:
#   rebuilt with today's kernel, it does not). Two 8-warp, 16-key, D=128 builds spill 8-24 B at
#   48-64 registers (sm_89 with 32 rows; sm_90 gathered, 16 rows): a ptxas choice no count
#   predicts; no default picks them.
# Rebuilt with today's kernel (the rule's pass region, 952 + 166 builds, benchmarks/RESULTS.md),
# 3.9 spills in 16 builds the rule passes: 4-24 B at 48-168 registers, such choices of ptxas, and
# one at 255 registers (bf16 on pages holding whole tiles, D=128, 16 rows, 128 keys, 4 warps: 12 B;
# whole-tile pages were not in the fit, and no default picks it).
# Triton 3.6 (ptxas 12.8 for both; the builds of the rule's pass region, benchmarks/RESULTS.md)
# spills where 3.9 does not, at 255 registers or close, in three places, which its profile prunes:
# - fp32 over a paged cache at 512 multiply-adds with fewer than 16 warps, whole tiles per page as
#   well as gathered (16 rows, D=128, 32 keys, 4 warps, pages of 32 or 256 tokens: 356 B; 3.9:
#   107 registers), so the paged bound is 256 for both;
# - fp32 at D=256 and 512 (16 rows, 16 keys, 4 warps, one query head per KV head: 4 B at 96
#   registers; 8 warps, 32 keys on sm_89: 32 B), so 256 there too, below 16 warps;
# - fp16/bf16 with 64 rows at D=256, 32 keys, 4 warps, state 144, on sm_89 (4 B, 20 B gathered;
#   8 B with 3 stages), so the 16-bit bound is fp8's 144.
# Its ptxas also spills a few bytes at 64-128 registers where no count predicts it (D=128, 16
# rows, 16 keys, 4 warps, contiguous: 12-16 B on sm_90, one local load per tile): the bounds above
# leave those alone, but no default of the compile test's launches picks one.
MAX_MMA_STATE_PER_THREAD = 160
MAX_MMA_STATE_PER_THREAD_FP8 = 144
MAX_FMA_PER_THREAD = 512
MAX_FMA_PER_THREAD_GATHERED = 256  # with fewer than GATHER_WIDE_WARPS warps
GATHER_WIDE_WARPS = 16


@dataclass(frozen=True)
class SpillProfile:
    """The spill rule's bounds for one compiler (see the comment above): tensor-core dots'
    ``acc / 2 + kv + s`` below ``mma`` (``mma_fp8`` over an fp8 cache); fp32's multiply-adds per
    thread at most ``fma``, and below ``wide_warps`` warps at most ``fma_gathered`` for tiles
    gathered key by key, ``fma_paged`` for whole tiles of a paged cache, ``fma_wide_head`` for a
    head dim above 128 (the smallest that applies).

    ``exact``: fitted to that compiler's builds: on the compile test's builds ptxas spills exactly
    where the rule prunes (the test checks both ways); over the whole tuning space some builds it
    passes still spill a few bytes where no count predicts it. Otherwise the bounds are
    conservative: no build of the sweep they pass spills at the register limit, and they prune
    every build a fitted profile prunes, and more (the compile test checks that no build they pass
    spills).
    """

    name: str
    exact: bool
    mma: int = MAX_MMA_STATE_PER_THREAD
    mma_fp8: int = MAX_MMA_STATE_PER_THREAD_FP8
    fma: int = MAX_FMA_PER_THREAD
    fma_gathered: int = MAX_FMA_PER_THREAD_GATHERED
    fma_paged: int = MAX_FMA_PER_THREAD
    fma_wide_head: int = MAX_FMA_PER_THREAD
    wide_warps: int = GATHER_WIDE_WARPS


TRITON_3_9 = SpillProfile("triton 3.9", exact=True)
TRITON_3_6 = SpillProfile("triton 3.6", exact=False, mma=MAX_MMA_STATE_PER_THREAD_FP8, fma_paged=256,
                          fma_wide_head=256)
# (major, minor) -> profile. Any other Triton gets the smallest bounds of all (UNFITTED), which
# benchmarks/spill_sweep.py checks against that Triton's ptxas; fit a profile from its output.
SPILL_PROFILES = {(3, 9): TRITON_3_9, (3, 6): TRITON_3_6}
UNFITTED = SpillProfile(
    "unfitted Triton (every profile's smallest bounds)", exact=False,
    mma=min(p.mma for p in SPILL_PROFILES.values()), mma_fp8=min(p.mma_fp8 for p in SPILL_PROFILES.values()),
    fma=min(p.fma for p in SPILL_PROFILES.values()),
    fma_gathered=min(p.fma_gathered for p in SPILL_PROFILES.values()),
    fma_paged=min(p.fma_paged for p in SPILL_PROFILES.values()),
    fma_wide_head=min(p.fma_wide_head for p in SPILL_PROFILES.values()),
    wide_warps=max(p.wide_warps for p in SPILL_PROFILES.values()),
)


def spill_profile(version: str | None = None) -> SpillProfile:
    """The :class:`SpillProfile` of Triton ``version`` ("3.6.0"; ``None``: the installed Triton,
    read from its package metadata without importing it; not installed: :data:`UNFITTED`)."""
    if version is None:
        version = _installed_triton()
    try:
        key = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return UNFITTED
    return SPILL_PROFILES.get(key, UNFITTED)


# The distributions that install the ``triton`` module: PyPI's, and PyTorch's nightly / ROCm builds.
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


@functools.lru_cache(maxsize=1)
def _installed_triton() -> str:
    from importlib import metadata

    for name in _TRITON_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


def spill_free(
    block_n: int, num_warps: int, head_dim: int, elem_bytes: int, group_rows: int = 16, warp_size: int = 32,
    *, gather: bool = False, paged: bool = False, dot_parts: int = 1, kv_bytes: int | None = None,
    profile: SpillProfile | None = None,
) -> bool:
    """Whether a stage-one program keeps its state in registers (see ``MAX_MMA_STATE_PER_THREAD``).

    Args:
        block_n, num_warps: the config's tile and warps.
        head_dim: D (padded to a power of two here, as the kernel's ``BLOCK_D``).
        elem_bytes: bytes of the dots' operands (:func:`dot_math`): 2 = tensor cores, 4 = fp32 FMA.
        group_rows: the padded query rows per program (:func:`group_block`).
        warp_size: threads per warp (32 NVIDIA, 64 AMD CDNA).
        gather: the tiles are gathered key by key from a paged cache (:func:`paged_gather`).
        paged: the cache is paged (whole tiles per page unless ``gather``).
        dot_parts: q and p enter the dots in this many parts (:func:`dot_math`).
        kv_bytes: the cache's element size if it differs from ``elem_bytes`` (1: fp8, widened).
        profile: the compiler's bounds (``None``: :func:`spill_profile` of the installed Triton).
    """
    p = spill_profile() if profile is None else profile
    d = padded_head_dim(head_dim)
    threads = num_warps * warp_size
    if elem_bytes == 4:
        limit = p.fma
        if num_warps < p.wide_warps:
            if gather:
                limit = min(limit, p.fma_gathered)
            elif paged:
                limit = min(limit, p.fma_paged)
            if d > 128:
                limit = min(limit, p.fma_wide_head)
        return group_rows * block_n * d <= limit * threads
    acc, kv, scores = group_rows * d, block_n * d, group_rows * block_n
    state = acc / 2 + kv + scores
    if dot_parts > 1:
        state += 1.5 * acc + 2 * scores
    limit = p.mma_fp8 if kv_bytes == 1 else p.mma
    return state < limit * threads


def stage1_spill_free(
    block_n: int, num_warps: int, shape: DecodeShape, dtype: Any, warp_size: int = 32, *, q_dtype: Any = None,
    profile: SpillProfile | None = None,
) -> bool:
    """:func:`spill_free` for a launch of ``shape`` over a ``dtype`` cache with a ``q_dtype``
    query (``None``: the same): the dots' operand size and parts (:func:`dot_math`), the padded
    query rows and whether the cache is paged and its tiles gathered key by key
    (:func:`paged_gather`); ``profile``: the compiler's bounds (``None``: the installed Triton's)."""
    from .. import dtypes as _dtypes

    elem, parts = dot_math(dtype if q_dtype is None else q_dtype, dtype)
    return spill_free(
        block_n, num_warps, shape.head_dim, elem, group_block(shape.query_rows), warp_size,
        gather=paged_gather(shape.block_size, block_n), paged=shape.block_size > 0, dot_parts=parts,
        kv_bytes=_dtypes.itemsize(dtype), profile=profile,
    )


def paged_gather(block_size: int, block_n: int) -> bool:
    """Whether a paged launch gathers its tiles key by key: pages that do not hold whole tiles
    (``block_size % block_n != 0``; see ``triton_decode``). False for a contiguous cache (0)."""
    return block_size > 0 and block_size % block_n != 0


def split_len(kv_len: int, num_splits: int, block_n: int) -> int:
    """Keys per split: ``ceil(N / splits)`` rounded up to whole tiles (at least one tile).

    Every split but the last covers exactly this many positions; splits past the end are empty.
    """
    per = -(-max(kv_len, 1) // num_splits)
    return max(block_n, -(-per // block_n) * block_n)


def default_num_splits(
    batch: int, kv_heads: int, kv_len: int, block_n: int, sm_count: int, *, group_blocks: int = 1
) -> int:
    """Number of KV splits for a launch when the config does not fix one.

    Decode attention is bound by memory bandwidth, and one SM streams only a slice of it: with one
    program per (row, KV head), batch 1 x 8 KV heads keeps 8 of an H100's 132 SMs busy. So:
    if ``batch x kv_heads`` programs already cover ``FULL_MACHINE_FRACTION`` of the SMs, 1 split
    (no partials, no second kernel). Else enough splits for ``TARGET_PROGRAMS_PER_SM`` programs per
    SM, no split shorter than ``MIN_TILES_PER_SPLIT`` tiles, at most ``HEURISTIC_MAX_SPLITS``; among
    the counts from that target up to 1.5x it, the one whose last wave over the SMs is fullest
    (wave quantisation: 133 equal programs on 132 SMs take two rounds).
    """
    base = max(1, batch * kv_heads * group_blocks)
    if base >= FULL_MACHINE_FRACTION * sm_count:
        return 1
    tiles = max(1, math.ceil(kv_len / block_n))
    cap = max(1, min(HEURISTIC_MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))
    want = math.ceil(TARGET_PROGRAMS_PER_SM * sm_count / base)
    if want <= 1:
        return 1
    if want >= cap:
        return cap
    best, best_eff = want, -1.0
    for s in range(want, min(cap, want + want // 2) + 1):
        programs = base * s
        eff = programs / (math.ceil(programs / sm_count) * sm_count)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def default_config(shape: DecodeShape, dtype: Any, device_spec: DeviceSpec, *, q_dtype: Any = None) -> DecodeConfig:
    """The config used when none is given, with ``num_splits`` resolved.

    ``dtype`` is the KV cache's, ``q_dtype`` the query's (``None``: the same); together they say
    how the dots compute (:func:`dot_math`).

    Tile and warp choices follow common Flash-Decoding practice for bandwidth-bound decode: 64 keys
    per tile (128 for D <= 64, 32 for D > 128 so the K/V tiles of two pipeline stages stay small;
    smaller where the program would spill registers (:func:`stage1_spill_free`): fp32 dots, 64-row
    query groups, per-key paged gathers), 4 warps (more for 64-row fp32 groups), 2 stages on
    NVIDIA (3 over an fp8 cache where shared memory allows: the same bytes in flight); on AMD 1
    stage (the stream pipeliner gains little on a loop this light) and ``waves_per_eu=2``.
    """
    from .. import dtypes as _dtypes

    d = shape.head_dim
    elem, parts = dot_math(dtype if q_dtype is None else q_dtype, dtype)
    kv_bytes = _dtypes.itemsize(dtype)
    block_n = 128 if d <= 64 else (64 if d <= 128 else 32)
    group_rows = group_block(shape.query_rows)
    warp = device_spec.warp_size
    num_warps = 4
    # Until nothing spills: smaller tiles, then more warps (the [rows, D] accumulator of a 64-row
    # fp32 group alone needs 8 warps).
    while not stage1_spill_free(block_n, num_warps, shape, dtype, warp, q_dtype=q_dtype):
        if block_n > MIN_BLOCK_N:
            block_n //= 2
        elif num_warps < MAX_NUM_WARPS:
            num_warps *= 2
        else:
            break
    amd = device_spec.vendor == "amd"
    num_stages = 1 if amd else 2
    smem_budget = SMEM_HEADROOM * device_spec.smem_per_sm_bytes
    if (kv_bytes < elem and not amd
            and TARGET_PROGRAMS_PER_SM * stage1_smem_bytes(block_n, 3, d, elem, group_rows, parts, kv_bytes)
            <= smem_budget):
        # An fp8 tile holds half the bytes of a 16-bit one: a third stage keeps two tiles' loads in
        # flight per program, as many bytes as a 16-bit cache's one (a loop that waits on memory
        # streams bytes in flight / latency; on an H200 the fp8 loop took as long per tile as bf16's
        # with half the bytes). Only where TARGET_PROGRAMS_PER_SM such programs still fit the SM's
        # shared memory (H100/H200: 2 x 55 KiB of 228; not an RTX 4090's 100 KiB).
        num_stages = 3
    # Shrink until the pipelined K/V tiles fit the SM's shared memory (fp32 D=256 on a 100 KiB
    # RTX 4090, say): fewer stages first, then smaller tiles.
    while stage1_smem_bytes(block_n, num_stages, d, elem, group_rows, parts, kv_bytes, nvidia=not amd) > smem_budget:
        if num_stages > 1:
            num_stages -= 1
        elif block_n > MIN_BLOCK_N:
            block_n //= 2
        else:
            break
    group_blocks = group_blocks_for(shape.query_rows)
    splits = default_num_splits(
        shape.batch, shape.kv_heads, shape.kv_len, block_n, device_spec.sm_count, group_blocks=group_blocks
    )
    return DecodeConfig(
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=splits,
        waves_per_eu=2 if amd else None,
    )


# A program handles all query heads of one KV head, padded to a tl.dot-friendly row count; past
# 64 query heads per KV head (MQA with many heads) the group is cut into blocks of 64 so the
# [group, D] accumulator stays in registers.
MIN_GROUP_BLOCK = 16
MAX_GROUP_BLOCK = 64


def group_block(group: int) -> int:
    """Rows of the padded query-head group per program: next power of two, 16..64."""
    g = 1 << max(0, (max(group, 1) - 1).bit_length())
    return max(MIN_GROUP_BLOCK, min(MAX_GROUP_BLOCK, g))


def group_blocks_for(group: int) -> int:
    """Programs per (row, KV head, split) needed to cover ``group`` query heads."""
    return max(1, math.ceil(max(group, 1) / group_block(group)))


def resolve_config(
    config: DecodeConfig | None, shape: DecodeShape, dtype: Any, device_spec: DeviceSpec, *, q_dtype: Any = None
) -> DecodeConfig:
    """``config`` with ``num_splits`` filled in by the heuristic if it is ``None``; default if no
    config (``dtype``: the cache's, ``q_dtype``: the query's, ``None`` = the same)."""
    if config is None:
        return default_config(shape, dtype, device_spec, q_dtype=q_dtype)
    if not isinstance(config, DecodeConfig):
        raise ConfigError(f"config must be a DecodeConfig or None; got {type(config).__name__}: {config!r}")
    if config.num_splits is None:
        splits = default_num_splits(
            shape.batch,
            shape.kv_heads,
            shape.kv_len,
            config.block_n,
            device_spec.sm_count,
            group_blocks=group_blocks_for(shape.query_rows),
        )
        return config.with_splits(splits)
    return config
