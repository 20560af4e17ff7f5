"""The napkin performance model and the config space: bytes counted right, monotonic in N,
under-filled machines penalised, candidates valid and ranked."""

from __future__ import annotations

import itertools

import pytest
import torch

from tree_attn.cost.devices import CPU_INTERPRETER, KNOWN_DEVICES, DeviceSpec, lookup_known_device
from tree_attn.cost.kernel import (
    best_predicted_config,
    candidate_configs,
    kv_bytes,
    predict,
    predict_time_us,
    rank_candidates,
)
from tree_attn.dtypes import itemsize as dtype_bytes
from tree_attn.errors import ConfigError
from tree_attn.kernels.config import DecodeConfig, default_config
from tree_attn.kernels.shapes import DecodeShape

H100 = KNOWN_DEVICES["h100-sxm"]
H200 = KNOWN_DEVICES["h200"]
MI300X = KNOWN_DEVICES["mi300x"]
RTX4090 = KNOWN_DEVICES["rtx4090"]
A100 = KNOWN_DEVICES["a100-sxm-80gb"]


def llama(batch: int, n: int) -> DecodeShape:
    return DecodeShape(batch=batch, q_heads=32, kv_heads=8, head_dim=128, kv_len=n)


def test_known_specs():
    assert (H100.sm_count, H200.sm_count, RTX4090.sm_count, MI300X.sm_count, A100.sm_count) == (132, 132, 128, 304, 108)
    assert H200.mem_bandwidth_gbps > H100.mem_bandwidth_gbps > A100.mem_bandwidth_gbps > RTX4090.mem_bandwidth_gbps
    assert MI300X.vendor == "amd" and MI300X.warp_size == 64
    for spec in KNOWN_DEVICES.values():
        assert spec.bandwidth_source == "datasheet" and spec.l2_bytes > 0


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_lookup_known_device(name, key):
    assert lookup_known_device(name) is KNOWN_DEVICES[key]


def test_lookup_unknown_and_cpu():
    assert lookup_known_device("NVIDIA GeForce GTX 1080") is None
    assert DeviceSpec.from_torch_device(torch.device("cpu")) is CPU_INTERPRETER
    if not torch.cuda.is_available():
        assert DeviceSpec.from_torch_device() is CPU_INTERPRETER


def test_device_spec_validation_and_measured_bandwidth():
    with pytest.raises(ConfigError, match="vendor.*'intel'"):
        DeviceSpec(name="x", vendor="intel", sm_count=1, mem_bandwidth_gbps=1.0)
    with pytest.raises(ConfigError, match="sm_count.*0"):
        DeviceSpec(name="x", vendor="nvidia", sm_count=0, mem_bandwidth_gbps=1.0)
    with pytest.raises(ConfigError, match="mem_bandwidth_gbps"):
        DeviceSpec(name="x", vendor="nvidia", sm_count=1, mem_bandwidth_gbps=-5.0)
    m = H100.with_measured_bandwidth(3000.0)
    assert m.bandwidth_source == "measured" and m.achievable_bandwidth_gbps == 3000.0
    assert H100.achievable_bandwidth_gbps < H100.mem_bandwidth_gbps  # datasheet peaks are not reached


def test_bytes_counted_right():
    shape = llama(2, 10000)
    assert dtype_bytes(torch.bfloat16) == 2 and dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4
    assert kv_bytes(shape, torch.bfloat16) == 2 * 2 * 10000 * 8 * 128 * 2
    one = predict(DecodeConfig(block_n=64, num_splits=1), shape, torch.bfloat16, H100)
    assert one.kv_bytes == kv_bytes(shape, torch.bfloat16)
    q = 2 * 32 * 128 * 2
    out_lse = 2 * 32 * (128 * 2 + 4)
    assert one.bytes_moved == one.kv_bytes + q + out_lse
    eight = predict(DecodeConfig(block_n=64, num_splits=8), shape, torch.bfloat16, H100)
    partials = 2 * 32 * 8 * (128 + 1) * 4
    # stage one: KV + q per split + fp32 partials; stage two: partials again + final out/lse.
    assert eight.bytes_moved == eight.kv_bytes + 8 * q + partials + partials + out_lse
    assert eight.programs == 2 * 8 * 8 and one.programs == 2 * 8


def test_fp8_bytes_and_candidates():
    """An fp8 cache is 1 byte per element in memory (half of bf16's bytes and time at long N),
    fp16 operands once loaded; its candidates are the 16-bit tiles that pass the fp8 spill rule."""
    from tree_attn.cost.kernel import element_sizes
    from tree_attn.kernels.config import stage1_spill_free

    fp8 = torch.float8_e4m3fn
    assert element_sizes(fp8) == (1, 2) and element_sizes("float8_e4m3fnuz") == (1, 2)
    assert element_sizes(torch.bfloat16) == (2, 2) and element_sizes(torch.float32) == (4, 4)
    shape = llama(2, 10000)
    assert kv_bytes(shape, fp8) * 2 == kv_bytes(shape, torch.bfloat16)
    cands = candidate_configs(llama(1, 262144), fp8, H100)
    assert {c.block_n for c in cands} == {32, 64, 128}
    assert all(stage1_spill_free(c.block_n, c.num_warps, llama(1, 262144), fp8) for c in cands)
    # the fp8 rule prunes more (a conservative bound): 128 keys x 4 warps over fp8, not over bf16
    bf16_cands = candidate_configs(llama(1, 262144), torch.bfloat16, H100)
    assert {(c.block_n, c.num_warps) for c in cands} < {(c.block_n, c.num_warps) for c in bf16_cands}
    for shape in (llama(64, 65536), llama(1, 1 << 20)):  # enough programs to stream at the card's rate
        t8 = predict(DecodeConfig(block_n=64), shape, fp8, H100)
        t16 = predict(DecodeConfig(block_n=64), shape, torch.bfloat16, H100)
        assert t8.bound == t16.bound == "memory" and 0.45 < t8.total_us / t16.total_us < 0.51


@pytest.mark.parametrize("spec", [H100, MI300X, RTX4090], ids=lambda s: s.name)
@pytest.mark.parametrize(
    "config",
    [DecodeConfig(block_n=64, num_splits=1), DecodeConfig(block_n=32, num_stages=3, num_splits=16),
     DecodeConfig(block_n=128, num_warps=8, num_splits=64), DecodeConfig(block_n=64, num_splits=None)],
    ids=lambda c: c.describe(),
)
def test_monotonic_in_n(spec, config):
    lengths = (1, 100, 4096, 65536, 262144, 1 << 20, 4 << 20)
    times = [predict_time_us(config, llama(1, n), "bf16", spec) for n in lengths]
    if config.num_splits is not None:
        assert all(a <= b for a, b in itertools.pairwise(times)), times
    assert times[-1] > times[0]


def test_never_faster_than_bandwidth():
    for cfg in candidate_configs(llama(4, 131072), "bf16", H100):
        p = predict(cfg, llama(4, 131072), "bf16", H100)
        assert p.total_us * 1e3 * H100.mem_bandwidth_gbps >= p.kv_bytes
        assert p.achieved_gbps <= H100.mem_bandwidth_gbps


def test_underfilled_machine_penalised():
    shape = llama(1, 65536)
    one = predict_time_us(DecodeConfig(block_n=64, num_splits=1), shape, "bf16", H100)
    many = predict_time_us(DecodeConfig(block_n=64, num_splits=32), shape, "bf16", H100)
    assert one > 3 * many  # 8 programs on 132 SMs cannot keep enough loads in flight
    # ... and a full machine reaches (a datasheet-derived fraction of) the bandwidth
    p = predict(DecodeConfig(block_n=64, num_splits=32), shape, "bf16", H100)
    assert p.achieved_gbps > 0.6 * H100.mem_bandwidth_gbps


def test_tail_wave_is_slow():
    # Same bytes, programs = slots versus slots + 1: the extra program runs alone in a second
    # round, at one SM's bandwidth.
    shape = DecodeShape(batch=1, q_heads=1, kv_heads=1, head_dim=128, kv_len=1 << 22)
    spec = DeviceSpec(name="toy", vendor="nvidia", sm_count=8, mem_bandwidth_gbps=1000.0, max_warps_per_sm=4)
    cfg_full = DecodeConfig(block_n=64, num_warps=4, num_splits=8)  # 1 program per SM, 8 slots
    cfg_tail = DecodeConfig(block_n=64, num_warps=4, num_splits=9)
    p_full = predict(cfg_full, shape, "bf16", spec)
    p_tail = predict(cfg_tail, shape, "bf16", spec)
    assert p_full.slots == 8 and p_tail.waves > 1
    assert p_tail.stage1_us > 1.2 * p_full.stage1_us


def test_more_bandwidth_is_faster_for_long_sequences():
    shape = llama(1, 1 << 20)
    assert predict_time_us(default_config(shape, "bf16", H200), shape, "bf16", H200) < predict_time_us(
        default_config(shape, "bf16", H100), shape, "bf16", H100
    )


def test_candidate_space():
    shape = llama(1, 131072)
    cands = candidate_configs(shape, torch.bfloat16, H100)
    assert len(cands) == len(set(cands)) > 50
    assert all(c.num_splits is not None and c.waves_per_eu is None for c in cands)
    assert {c.block_n for c in cands} == {32, 64, 128}
    assert 1 in {c.num_splits for c in cands} and default_config(shape, "bf16", H100).num_splits in {
        c.num_splits for c in cands
    }
    amd = candidate_configs(shape, torch.bfloat16, MI300X)
    assert all(c.waves_per_eu is not None for c in amd) and max(c.num_stages for c in amd) <= 2
    # D=256 fp32 on a 100 KiB-shared-memory card: deep pipelines of 128-key tiles do not fit.
    big = candidate_configs(DecodeShape(1, 8, 8, 256, 65536), torch.float32, RTX4090)
    assert not any(c.block_n == 128 and c.num_stages >= 2 for c in big)
    # fp32 tiles are 16-64 keys, and no candidate spills registers (fp32 D=256 needs 8 warps above 16 keys).
    assert {c.block_n for c in big} <= {16, 32, 64} and 16 in {c.block_n for c in big}
    assert all(c.num_warps == 8 for c in big if c.block_n == 32)
    assert not any(c.num_warps == 2 and c.block_n == 128 for c in cands)  # bf16 D=128: 288 elements/thread
    # A 64-row query group (MQA) on a 4090: shared memory counts the group's q tile and the wgmma/mma layouts.
    mqa = candidate_configs(DecodeShape(1, 64, 1, 256, 65536), torch.bfloat16, RTX4090)
    assert mqa and all(c.block_n * c.num_stages <= 64 for c in mqa)
    short = candidate_configs(llama(1, 64), "bf16", H100)
    assert all(c.num_splits == 1 for c in short if c.block_n == 64)


def test_rank_and_prune():
    shape = llama(1, 131072)
    cands = candidate_configs(shape, "bf16", H100)
    ranked = rank_candidates(cands, shape, "bf16", H100)
    assert len(ranked) == len(cands)
    times = [r.predicted_us for r in ranked]
    assert times == sorted(times)
    top = rank_candidates(cands, shape, "bf16", H100, top_k=5)
    assert [r.config for r in top] == [r.config for r in ranked[:5]]
    near = rank_candidates(cands, shape, "bf16", H100, max_slowdown=1.2)
    assert all(r.predicted_us <= 1.2 * ranked[0].predicted_us for r in near) and len(near) < len(cands)
    assert ranked[0].config.num_splits > 1  # batch 1 on 132 SMs wants splits
    assert best_predicted_config(shape, "bf16", H100) == ranked[0].config
    with pytest.raises(ConfigError, match="top_k"):
        rank_candidates(cands, shape, "bf16", H100, top_k=0)
    with pytest.raises(ConfigError, match="max_slowdown"):
        rank_candidates(cands, shape, "bf16", H100, max_slowdown=0.5)


def test_default_config_is_near_model_best():
    """The launch-time heuristic should not be far from what the model thinks is best."""
    for batch, n in [(1, 65536), (1, 1 << 20), (8, 131072), (16, 4096)]:
        shape = llama(batch, n)
        best = rank_candidates(candidate_configs(shape, "bf16", H100), shape, "bf16", H100, top_k=1)[0]
        heur = predict_time_us(default_config(shape, "bf16", H100), shape, "bf16", H100)
        assert heur <= 1.5 * best.predicted_us, (batch, n, heur, best)
