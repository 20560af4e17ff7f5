"""DecodeConfig validation and serialisation, and the default split heuristic."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tree_attn.errors import ConfigError
from tree_attn.kernels.config import (
    HEURISTIC_MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    DecodeConfig,
    default_config,
    default_num_splits,
    group_block,
    group_blocks_for,
    resolve_config,
    spill_free,
    split_len,
    stage1_smem_bytes,
)
from tree_attn.cost.devices import KNOWN_DEVICES
from tree_attn.kernels.shapes import DecodeShape

H100 = KNOWN_DEVICES["h100-sxm"]
MI300X = KNOWN_DEVICES["mi300x"]


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
                s = split_len(n, splits, bn)
                assert s % bn == 0 and s >= bn
                assert s * splits >= n  # every key is in some split
                assert s - bn < math.ceil(n / splits)  # no whole tile of slack per split


def test_group_blocks():
    assert group_block(1) == 16 and group_block(4) == 16 and group_block(8) == 16
    assert group_block(32) == 32 and group_block(128) == 64
    assert group_blocks_for(4) == 1 and group_blocks_for(128) == 2 and group_blocks_for(96) == 2


def test_heuristic_fills_big_gpu_at_batch_one():
    s = default_num_splits(1, 8, 131072, 64, H100.sm_count)
    programs = 8 * s
    assert programs >= 2 * H100.sm_count  # at least ~2 waves of programs
    assert s <= HEURISTIC_MAX_SPLITS
    assert math.ceil(131072 / 64) // s >= MIN_TILES_PER_SPLIT


def test_heuristic_no_split_when_batch_fills_machine_or_sequence_short():
    assert default_num_splits(128, 8, 131072, 64, H100.sm_count) == 1
    assert default_num_splits(1, 8, 64, 64, H100.sm_count) == 1  # one tile: nothing to split
    s = default_num_splits(1, 8, 64 * 10, 64, H100.sm_count)
    assert s <= 10 // MIN_TILES_PER_SPLIT  # never below MIN_TILES_PER_SPLIT tiles per split


def test_heuristic_scales_with_cu_count_and_batch():
    big = default_num_splits(1, 8, 1 << 20, 64, MI300X.sm_count)
    small = default_num_splits(1, 8, 1 << 20, 64, H100.sm_count)
    assert big >= small
    assert default_num_splits(16, 8, 1 << 20, 64, H100.sm_count) < small


def test_default_config_and_resolve():
    shape = llama(1, 65536)
    c = default_config(shape, "bf16", H100)
    assert c.num_splits is not None and c.num_splits > 1 and c.waves_per_eu is None
    amd = default_config(shape, "bf16", MI300X)
    assert amd.waves_per_eu is not None
    r = resolve_config(DecodeConfig(block_n=32), shape, "bf16", H100)
    assert r.block_n == 32 and r.num_splits == default_num_splits(1, 8, 65536, 32, H100.sm_count)
    fixed = DecodeConfig(num_splits=3)
    assert resolve_config(fixed, shape, "bf16", H100) is fixed
    assert resolve_config(None, shape, "bf16", H100) == c
    with pytest.raises(ConfigError, match="DecodeConfig"):
        resolve_config({"block_n": 64}, shape, "bf16", H100)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype,elem", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16, 64])
def test_default_config_never_spills_nor_overflows_shared_memory(dtype, elem, d, group):
    for spec in (H100, MI300X, KNOWN_DEVICES["rtx4090"]):
        shape = DecodeShape(batch=1, q_heads=2 * group, kv_heads=2, head_dim=d, kv_len=65536)
        c = default_config(shape, dtype, spec)
        assert spill_free(c.block_n, c.num_warps, d, elem, group_block(group), spec.warp_size), (spec.name, c)
        fits = stage1_smem_bytes(c.block_n, c.num_stages, d, elem, group_block(group)) <= 0.85 * spec.smem_per_sm_bytes
        # fp32 D=256 with 64 query rows: the q tile alone is 64 KiB, all of an MI300X CU's LDS; the
        # default can only shrink as far as it goes (the launch then fails with a ConfigError).
        assert fits or (c.block_n == 16 and c.num_stages == 1 and elem * d * group_block(group) >= 64 * 1024), (spec.name, c)


def test_default_tiles_by_dtype_and_head_dim():
    """bf16 keeps the usual Flash-Decoding tiles; fp32 (FMA dots) takes half-size tiles."""
    for d, bf16_bn, fp32_bn in ((64, 128, 64), (128, 64, 32), (256, 32, 16)):
        shape = DecodeShape(batch=1, q_heads=32, kv_heads=8, head_dim=d, kv_len=65536)
        assert default_config(shape, "bf16", H100).block_n == bf16_bn
        assert default_config(shape, "fp32", H100).block_n == fp32_bn


def test_spill_rule_boundaries():
    # Points measured with ptxas -v (see MAX_STATE_ELEMS_PER_THREAD); tests/kernels/test_triton_compile.py re-checks them.
    assert spill_free(64, 2, 128, 2, 16)  # 255 registers, no spill
    assert not spill_free(128, 2, 128, 2, 16)  # 44 B spilled
    assert spill_free(16, 4, 256, 4, 16)  # 140 registers
    assert not spill_free(32, 4, 256, 4, 16)  # 9 KB spilled
    assert spill_free(64, 4, 128, 2, 64) and not spill_free(32, 4, 256, 2, 64)
