"""DecodeConfig validation and serialisation, and the default split heuristic."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tree_attn.cost.devices import KNOWN_DEVICES
from tree_attn.errors import ConfigError
from tree_attn.kernels import config as kc
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.shapes import DecodeShape

H100 = KNOWN_DEVICES["h100-sxm"]
MI300X = KNOWN_DEVICES["mi300x"]
PROFILES = [kc.TRITON_3_9, kc.TRITON_3_6, kc.UNFITTED]
_spill_profile = kc.spill_profile


def use_profile(monkeypatch, profile: kc.SpillProfile) -> None:
    """Make the spill rule (and the defaults it shapes) use ``profile``, whatever Triton is installed."""
    monkeypatch.setattr(kc, "spill_profile", lambda version=None: profile)


@pytest.fixture(autouse=True)
def _fitted_profile(monkeypatch):
    """The configs these tests state are Triton 3.9's (the fitted profile), whatever Triton is
    installed; a test about another profile sets it with use_profile."""
    use_profile(monkeypatch, kc.TRITON_3_9)


def llama(batch: int, n: int) -> DecodeShape:
    return DecodeShape(batch=batch, q_heads=32, kv_heads=8, head_dim=128, kv_len=n)


def test_defaults_are_valid():
    c = DecodeConfig()
    assert (c.block_n, c.num_warps, c.num_stages, c.num_splits, c.waves_per_eu) == (64, 4, 2, None, None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_n", 48),  # not a power of two
        ("block_n", 8),  # below tl.dot's 16
        ("block_n", 1024),
        ("block_n", 64.0),
        ("block_n", True),
        ("num_warps", 3),
        ("num_warps", 0),
        ("num_warps", 32),
        ("num_stages", 0),
        ("num_stages", 9),
        ("num_splits", 0),
        ("num_splits", -2),
        ("num_splits", 5000),
        ("num_splits", "4"),
        ("waves_per_eu", -1),
        ("waves_per_eu", 9),
        ("block_n", None),
    ],
)
def test_bad_values_name_field_and_value(field, value):
    with pytest.raises(ConfigError) as err:
        DecodeConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and repr(value).strip("'") in msg


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodeConfig().block_n = 32  # type: ignore[misc]


def test_dict_round_trip_and_unknown_keys():
    c = DecodeConfig(block_n=32, num_warps=8, num_stages=3, num_splits=16, waves_per_eu=2)
    d = c.to_dict()
    assert list(d) == ["block_n", "num_warps", "num_stages", "num_splits", "waves_per_eu"]
    assert DecodeConfig.from_dict(d) == c
    assert DecodeConfig.from_dict({"block_n": 128}) == DecodeConfig(block_n=128)
    with pytest.raises(ConfigError, match="block_m"):
        DecodeConfig.from_dict({"block_m": 64})
    with pytest.raises(ConfigError, match="mapping"):
        DecodeConfig.from_dict([("block_n", 64)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_warps"):
        DecodeConfig.from_dict({"num_warps": 5})


def test_split_len_covers_sequence_in_whole_tiles():
    for n in (1, 5, 63, 64, 65, 1000, 131072 + 17):
        for splits in (1, 2, 3, 7, 64):
            for bn in (16, 64):
                s = kc.split_len(n, splits, bn)
                assert s % bn == 0 and s >= bn
                assert s * splits >= n  # every key is in some split
                assert s - bn < math.ceil(n / splits)  # no whole tile of slack per split


def test_group_blocks():
    assert kc.group_block(1) == 16 and kc.group_block(4) == 16 and kc.group_block(8) == 16
    assert kc.group_block(32) == 32 and kc.group_block(128) == 64
    assert kc.group_blocks_for(4) == 1 and kc.group_blocks_for(128) == 2 and kc.group_blocks_for(96) == 2


def test_heuristic_fills_big_gpu_at_batch_one():
    s = kc.default_num_splits(1, 8, 131072, 64, H100.sm_count)
    programs = 8 * s
    assert programs >= 2 * H100.sm_count  # at least ~2 waves of programs
    assert s <= kc.HEURISTIC_MAX_SPLITS
    assert math.ceil(131072 / 64) // s >= kc.MIN_TILES_PER_SPLIT


def test_heuristic_no_split_when_batch_fills_machine_or_sequence_short():
    assert kc.default_num_splits(128, 8, 131072, 64, H100.sm_count) == 1
    assert kc.default_num_splits(1, 8, 64, 64, H100.sm_count) == 1  # one tile: nothing to split
    s = kc.default_num_splits(1, 8, 64 * 10, 64, H100.sm_count)
    assert s <= 10 // kc.MIN_TILES_PER_SPLIT  # never below kc.MIN_TILES_PER_SPLIT tiles per split


def test_heuristic_scales_with_cu_count_and_batch():
    big = kc.default_num_splits(1, 8, 1 << 20, 64, MI300X.sm_count)
    small = kc.default_num_splits(1, 8, 1 << 20, 64, H100.sm_count)
    assert big >= small
    assert kc.default_num_splits(16, 8, 1 << 20, 64, H100.sm_count) < small


def test_default_config_and_resolve():
    shape = llama(1, 65536)
    c = kc.default_config(shape, "bf16", H100)
    assert c.num_splits is not None and c.num_splits > 1 and c.waves_per_eu is None
    amd = kc.default_config(shape, "bf16", MI300X)
    assert amd.waves_per_eu is not None
    r = kc.resolve_config(DecodeConfig(block_n=32), shape, "bf16", H100)
    assert r.block_n == 32 and r.num_splits == kc.default_num_splits(1, 8, 65536, 32, H100.sm_count)
    fixed = DecodeConfig(num_splits=3)
    assert kc.resolve_config(fixed, shape, "bf16", H100) is fixed
    assert kc.resolve_config(None, shape, "bf16", H100) == c
    with pytest.raises(ConfigError, match="DecodeConfig"):
        kc.resolve_config({"block_n": 64}, shape, "bf16", H100)  # type: ignore[arg-type]


FP8 = "float8_e4m3fn"


@pytest.mark.parametrize("q_dtype,dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("fp16", "bf16"),
                                           ("fp32", "bf16"), ("bf16", "fp16"), ("bf16", FP8), ("fp16", FP8),
                                           ("fp32", FP8)])
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name.split(" (")[0])
def test_default_config_never_spills_nor_overflows_shared_memory(q_dtype, dtype, profile, monkeypatch):
    """On every device, for every dtype mix, head dim, group and paged layout, the default config is
    one the spill rule passes, under every compiler's profile (tests/kernels/test_triton_compile.py
    checks the installed Triton's rule against ptxas)."""
    from tree_attn.dtypes import itemsize

    use_profile(monkeypatch, profile)

    elem, parts = kc.dot_math(q_dtype, dtype)
    kv = itemsize(dtype)
    for d, group, page, spec in itertools.product(
        (64, 80, 96, 128, 256), (1, 4, 8, 16, 32, 64), (0, 1, 16, 17, 256), (H100, MI300X, KNOWN_DEVICES["rtx4090"])
    ):
        blocks = 4 if page else 0
        shape = DecodeShape(batch=1, q_heads=2 * group, kv_heads=2, head_dim=d, kv_len=page * blocks or 65536,
                            block_size=page, num_blocks=blocks)
        c = kc.default_config(shape, dtype, spec, q_dtype=q_dtype)
        where = (spec.name, d, group, page, c)
        assert kc.stage1_spill_free(c.block_n, c.num_warps, shape, dtype, spec.warp_size, q_dtype=q_dtype), where
        limit = 0.85 * spec.smem_per_sm_bytes
        nvidia = spec.vendor != "amd"
        fits = kc.stage1_smem_bytes(c.block_n, c.num_stages, d, elem, kc.group_block(group), parts, kv,
                                    nvidia=nvidia) <= limit
        # The q tiles alone fill the LDS / shared memory: 64 query rows at fp32 D=256, or an fp32
        # query's 3 parts at D=256 with 32 rows (MI300X's 64 KiB) or 64 rows (RTX 4090's 100 KiB);
        # the default shrinks as far as it goes (the launch then fails with a ConfigError that says so).
        smallest = kc.stage1_smem_bytes(16, 1, d, elem, kc.group_block(group), parts, kv, nvidia=nvidia)
        assert fits or ((c.block_n, c.num_stages) == (16, 1) and smallest > limit), where
        if not fits:
            assert spec is MI300X or (parts == 3 and kc.group_block(group) == 64), where


def test_default_tiles_by_dtype_and_head_dim(monkeypatch):
    """bf16 keeps the usual Flash-Decoding tiles; fp32 (FMA dots) takes half-size tiles (Triton 3.9;
    3.6 gives D=256 8 warps, and a paged fp32 cache 16-key tiles)."""
    for d, bf16_bn, fp32_bn in ((64, 128, 64), (128, 64, 32), (256, 32, 16)):
        shape = DecodeShape(batch=1, q_heads=32, kv_heads=8, head_dim=d, kv_len=65536)
        assert kc.default_config(shape, "bf16", H100).block_n == bf16_bn
        assert kc.default_config(shape, "fp32", H100).block_n == fp32_bn
    paged = DecodeShape(batch=4, q_heads=32, kv_heads=8, head_dim=128, kv_len=8192, block_size=32, num_blocks=128)
    mha256 = DecodeShape(batch=1, q_heads=8, kv_heads=8, head_dim=256, kv_len=8192)
    mqa256 = DecodeShape(batch=1, q_heads=64, kv_heads=1, head_dim=256, kv_len=32768)

    def tile(shape, dtype):
        c = kc.default_config(shape, dtype, H100)
        return c.block_n, c.num_warps

    assert (tile(paged, "fp32"), tile(mha256, "fp32"), tile(mqa256, "bf16")) == ((32, 4), (16, 4), (32, 4))
    use_profile(monkeypatch, kc.TRITON_3_6)
    assert (tile(paged, "fp32"), tile(mha256, "fp32"), tile(mqa256, "bf16")) == ((16, 4), (16, 8), (16, 4))
    llama_fp32 = DecodeShape(batch=1, q_heads=32, kv_heads=8, head_dim=128, kv_len=16384)
    assert tile(llama_fp32, "fp32") == (32, 4)  # contiguous, D <= 128: as 3.9


def test_spill_profiles_by_triton_version():
    """Each fitted Triton gets its profile; any other (or none) the smallest bounds of all. A
    conservative profile prunes every build the fitted one prunes, so its defaults and candidates
    are a subset."""
    assert _spill_profile("3.9.0") is kc.TRITON_3_9 and _spill_profile("3.6.0+git1234") is kc.TRITON_3_6
    assert _spill_profile("3.10.0") is _spill_profile("3.5.1") is _spill_profile("") is kc.UNFITTED
    assert kc.TRITON_3_9.exact and not kc.TRITON_3_6.exact and not kc.UNFITTED.exact
    for profile in (kc.TRITON_3_6, kc.UNFITTED):
        for d, rows, bn, warps, elem, parts, kv, gather, paged in itertools.product(
            (64, 128, 256), (16, 32, 64), (16, 32, 64, 128), (2, 4, 8, 16), (2, 4), (1, 2, 3), (None, 1),
            (False, True), (False, True),
        ):
            kw = dict(gather=gather and paged, paged=paged, dot_parts=parts, kv_bytes=kv)
            if kc.spill_free(bn, warps, d, elem, rows, profile=profile, **kw):
                assert kc.spill_free(bn, warps, d, elem, rows, profile=kc.TRITON_3_9, **kw), (profile.name, kw)


def test_spill_rule_boundaries():
    # Builds measured with ptxas -v (Triton 3.9, sm_90; see the comment above MAX_MMA_STATE_PER_THREAD);
    # tests/kernels/test_triton_compile.py re-checks such points on real launches. (The autouse
    # fixture makes the rule Triton 3.9's.)
    assert kc.spill_free(64, 4, 128, 2, 16)  # the bf16 default: 133 registers
    assert not kc.spill_free(64, 2, 128, 2, 16)  # 4 B spilled
    assert not kc.spill_free(128, 2, 128, 2, 16)  # 220 B spilled
    assert kc.spill_free(64, 4, 128, 2, 64) and not kc.spill_free(128, 4, 128, 2, 64)  # 64 rows: 220 registers / 128 B
    assert kc.spill_free(64, 4, 128, 2, 16, dot_parts=2)  # a bf16 cache, fp16 q: no spill
    assert not kc.spill_free(64, 4, 128, 2, 64, dot_parts=2)  # 76 B spilled (without parts: 220 registers)
    assert kc.spill_free(32, 4, 128, 4, 16) and kc.spill_free(16, 4, 256, 4, 16)  # fp32 defaults: 107 / 138 registers
    assert not kc.spill_free(32, 4, 256, 4, 16)  # 16 B spilled
    assert not kc.spill_free(64, 4, 64, 4, 64) and kc.spill_free(16, 4, 64, 4, 64)  # 64-row fp32: 824 B / 222 registers
    # 32-row fp32: 1,148 B / 190 registers
    assert not kc.spill_free(32, 4, 128, 4, 32) and kc.spill_free(16, 4, 128, 4, 32)
    assert kc.spill_free(32, 4, 128, 4, 16) and not kc.spill_free(32, 4, 128, 4, 16, gather=True)  # paged gather: 524 B
    assert kc.spill_free(16, 4, 128, 4, 16, gather=True)  # 72 registers
    # Gathered, 64 rows (2 KV heads), 16 keys: 8 warps 568 B at 255 registers, 16 warps 66 registers.
    assert not kc.spill_free(16, 8, 128, 4, 64, gather=True, paged=True)
    assert kc.spill_free(16, 16, 128, 4, 64, gather=True, paged=True)
    # fp8 caches (tiles widened to fp16): a lower bound than 16-bit caches' (sm_90, bf16 query),
    # conservative since V's widening stays in place (registers of the current builds).
    assert kc.spill_free(64, 4, 128, 2, 16, kv_bytes=1)  # the fp8 tile and warps of the default: 122 registers
    assert kc.spill_free(128, 4, 128, 2, 16) and not kc.spill_free(128, 4, 128, 2, 16, kv_bytes=1)  # 174, pruned
    assert not kc.spill_free(128, 2, 128, 2, 16, kv_bytes=1)  # 68 B spilled
    assert kc.spill_free(128, 8, 128, 2, 16, kv_bytes=1)  # 118 registers
    assert not kc.spill_free(64, 2, 128, 2, 32, kv_bytes=1)  # fp16 query, 32 rows: 8 B spilled
    assert kc.spill_free(64, 4, 128, 2, 64, kv_bytes=1)  # 64 rows (wgmma)
    assert kc.spill_free(64, 4, 128, 2, 16, dot_parts=3, kv_bytes=1)  # fp32 query's 3 parts: 142 registers


def test_spill_rule_boundaries_triton_3_6():
    # Triton 3.6's builds (ptxas 12.8) where 3.9's rule passes and they spill at 255 registers, and
    # their neighbours that keep their registers (benchmarks/RESULTS.md).
    p = kc.TRITON_3_6
    # fp32, D=128, 16 rows, 32 keys, 4 warps: contiguous 80 registers; pages of 32 / 256 tokens
    # (whole tiles, one block id per tile) 356 B; 16 keys paged: 80 registers.
    assert kc.spill_free(32, 4, 128, 4, 16, profile=p) and kc.spill_free(32, 4, 128, 4, 16, profile=kc.TRITON_3_9)
    assert not kc.spill_free(32, 4, 128, 4, 16, paged=True, profile=p)
    assert kc.spill_free(32, 4, 128, 4, 16, paged=True, profile=kc.TRITON_3_9)  # 107 registers under 3.9
    assert kc.spill_free(16, 4, 128, 4, 16, paged=True, profile=p)
    assert not kc.spill_free(64, 8, 128, 4, 16, paged=True, profile=p)  # 344 B with 8 warps too
    assert not kc.spill_free(16, 8, 128, 4, 64, gather=True, paged=True, profile=p)  # 536 B gathered
    # fp32 D=256, 16 rows, 16 keys: 4 warps 4 B spilled (96 registers), 8 warps 80 registers; 64
    # rows with 16 warps keep theirs (104 registers).
    assert not kc.spill_free(16, 4, 256, 4, 16, profile=p) and kc.spill_free(16, 8, 256, 4, 16, profile=p)
    assert kc.spill_free(16, 16, 256, 4, 64, profile=p)
    # 16-bit, 64 rows, D=256, 32 keys, 4 warps: 255 registers and 4 B spilled on sm_89 (8 B with 3
    # stages); 16 keys fit.
    assert not kc.spill_free(32, 4, 256, 2, 64, profile=p) and kc.spill_free(32, 4, 256, 2, 64, profile=kc.TRITON_3_9)
    assert kc.spill_free(16, 4, 256, 2, 64, profile=p)
    assert kc.spill_free(64, 4, 128, 2, 16, profile=p)  # the bf16 default: 128 registers


def test_dot_math_and_paged_gather():
    assert kc.dot_math("bf16", "bf16") == (2, 1) and kc.dot_math("fp32", "fp32") == (4, 1)
    assert kc.dot_math("fp16", "bf16") == (2, 2) and kc.dot_math("fp32", "bf16") == (2, 3)
    # fp16 holds a bf16 value in one part (after a prescale into its range), fp32 in 3; an fp32
    # cache is fp32 math.
    assert kc.dot_math("bf16", "fp16") == (2, 1) and kc.dot_math("fp32", "fp16") == (2, 3)
    assert kc.dot_math("fp16", "fp32") == (4, 1) and kc.dot_math("bf16", "fp32") == (4, 1)
    assert not kc.paged_gather(0, 64) and not kc.paged_gather(16, 16) and not kc.paged_gather(256, 64)
    assert kc.paged_gather(16, 32) and kc.paged_gather(1, 16) and kc.paged_gather(17, 16)
    # fp8 tiles widen to fp16: the dots of an fp16 cache.
    for q in ("bf16", "fp16", "fp32"):
        assert kc.dot_math(q, FP8) == kc.dot_math(q, "fp16") == kc.dot_math(q, "float8_e4m3fnuz")


def test_fp8_shared_memory_estimate():
    """fp8 K/V tiles are staged as fp8, and on NVIDIA the V tile once more as fp16 (read back
    transposed): what Triton 3.9 allocates for sm_89/sm_90 (D=128, 16 rows, 64 keys: 1 / 2 / 3
    stages 22 / 38 / 54 KiB; an fp32 query's 3 parts 50 KiB at 2 stages), within the estimate,
    which is exact (plus its 1 KiB of scratch) from 2 stages. AMD builds widen V in registers."""
    assert kc.stage1_smem_bytes(64, 2, 128, 2, 16, 1, kv_bytes=1) == 38912 + 1024
    assert kc.stage1_smem_bytes(64, 3, 128, 2, 16, 1, kv_bytes=1) == 55296 + 1024
    assert kc.stage1_smem_bytes(64, 2, 128, 2, 16, 3, kv_bytes=1) == 51200 + 1024
    assert kc.stage1_smem_bytes(64, 1, 128, 2, 16, 1, kv_bytes=1) >= 22528
    assert kc.stage1_smem_bytes(64, 2, 128, 2, 16, 1, kv_bytes=1, nvidia=False) == 22528 + 1024
    assert kc.stage1_smem_bytes(64, 2, 128, 2, 16, 1) == 38912 + 1024  # a bf16 cache
    assert kc.stage1_smem_bytes(64, 2, 128, 2, 16, 1, nvidia=False) == 38912 + 1024


def test_fp8_defaults():
    """fp8 keeps the 16-bit tiles (the same keys per tile, half the bytes), whatever q's dtype,
    with a third pipeline stage on NVIDIA GPUs whose shared memory holds two such programs (the
    same K/V bytes in flight per program as a 16-bit cache's two stages): H100, not RTX 4090; AMD
    keeps its one stage."""
    for d, bn in ((64, 128), (128, 64), (256, 32)):
        shape = DecodeShape(batch=1, q_heads=32, kv_heads=8, head_dim=d, kv_len=65536)
        for q in ("bf16", "fp16", "fp32"):
            c = kc.default_config(shape, FP8, H100, q_dtype=q)
            assert (c.block_n, c.num_warps, c.num_stages) == (bn, 4, 3), (d, q, c)
            c = kc.default_config(shape, FP8, KNOWN_DEVICES["rtx4090"], q_dtype=q)
            assert (c.block_n, c.num_warps, c.num_stages) == (bn, 4, 2), (d, q, c)
            c = kc.default_config(shape, FP8, MI300X, q_dtype=q)
            assert (c.block_n, c.num_stages) == (bn, 1), (d, q, c)
            # a 16-bit cache keeps 2 stages on H100
            assert kc.default_config(shape, "bf16", H100, q_dtype=q).num_stages == 2


def test_mixed_and_paged_defaults():
    """Builds that spilled get configs the rule passes: fp32 pages of 16 keep 16-key tiles (one
    block id per tile, no gather); a 64-row fp32 group at D=64 takes 16 keys; a 16-bit cache with a
    query of another dtype keeps the cache's tiles (its dots stay on tensor cores)."""
    paged = DecodeShape(batch=4, q_heads=32, kv_heads=8, head_dim=128, kv_len=8192, block_size=16, num_blocks=2048)
    assert kc.default_config(paged, "fp32", H100).block_n == 16
    mqa = DecodeShape(batch=1, q_heads=64, kv_heads=1, head_dim=64, kv_len=8192)
    assert (kc.default_config(mqa, "fp32", H100).block_n, kc.default_config(mqa, "fp32", H100).num_warps) == (16, 4)
    shape = llama(1, 16384)
    assert (kc.default_config(shape, "bf16", H100, q_dtype="fp16").block_n
            == kc.default_config(shape, "bf16", H100).block_n == 64)
    assert kc.default_config(shape, "fp16", H100, q_dtype="bf16") == kc.default_config(shape, "fp16", H100)
    assert kc.default_config(shape, "fp16", H100, q_dtype="fp32").block_n == 64
    # 64 query rows in 2 parts: the parts' registers shrink the tile
    mqa = DecodeShape(batch=1, q_heads=64, kv_heads=1, head_dim=128, kv_len=8192)
    assert kc.default_config(mqa, "bf16", H100, q_dtype="fp16").block_n < kc.default_config(mqa, "bf16", H100).block_n
    assert (kc.resolve_config(None, shape, "bf16", H100, q_dtype="fp32")
            == kc.default_config(shape, "bf16", H100, q_dtype="fp32"))
