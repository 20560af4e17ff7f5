"""What the launching process learns of its ranks' GPUs through NVML, without a CUDA context
(``tree_attn.launch.gpus``), with a fake NVML: the visible GPUs in CUDA's order, their least free
memory, their compute capabilities, and the fp8 launch check of ``run`` built on them."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.topology.fakes import FakeGpu, make_pynvml
from tree_attn.launch import gpus

GiB = 1 << 30


def _gpu(i: int, memory_gib: int, cc: tuple[int, int]) -> FakeGpu:
    return FakeGpu(name=f"GPU {i}", bus=f"00000000:{0x10 * (i + 1):02X}:00.0", uuid=f"GPU-fake-{i}",
                   memory=memory_gib * GiB, sms=100, arch=8, numa=0, cpus=[0], pcie=(4, 16), cc=cc)


@pytest.fixture
def box(monkeypatch):
    """A mixed box as NVML sees it (PCI bus order): an H100 80 GB, an A100 40 GB, an L40S 48 GB.
    Returns a function that installs it as ``pynvml``; torch's CUDA queries fail the test."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

    def asked_torch(*args, **kwargs):
        raise AssertionError("the launching process asked torch (a CUDA context) instead of NVML")

    monkeypatch.setattr(torch.cuda, "get_device_capability", asked_torch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", asked_torch)
    fake = make_pynvml([_gpu(0, 80, (9, 0)), _gpu(1, 40, (8, 0)), _gpu(2, 48, (8, 9))],
                       ancestor=lambda a, b: 50, p2p=lambda a, b, idx: 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_visible_gpus_follow_cuda_visible_devices(box, monkeypatch):
    assert gpus.gpu_capabilities() == [(9, 0), (8, 0), (8, 9)]
    assert gpus.gpu_free_bytes() == 40 * GiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-fake-0")  # by index and by UUID, in that order
    assert gpus.gpu_capabilities() == [(8, 9), (9, 0)]
    assert gpus.gpu_free_bytes() == 48 * GiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7,0")  # CUDA stops at the first index that names no GPU
    assert gpus.gpu_capabilities() == [(8, 9)]


def test_an_unknown_order_or_no_nvml_gives_no_per_device_answer(box, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # cuda:i may be any of the three
    assert gpus.gpu_capabilities() is None
    assert gpus.gpu_free_bytes() == 40 * GiB  # the least of them holds whatever the order
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.gpu_capabilities() == [(9, 0)]  # one GPU: no order to know
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-none")  # NVML: not found
    assert gpus.gpu_capabilities() is None and gpus.gpu_free_bytes() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert gpus.gpu_capabilities() is None and gpus.gpu_free_bytes() is None


def test_fp8_on_gpus_without_it_is_refused_before_launch(box, monkeypatch):
    """``run --kv-dtype fp8`` on spawned GPU ranks: each rank's GPU by NVML (this process makes no
    CUDA context), refused in the kernel's own words below compute capability 8.9; where NVML
    cannot say, the ranks refuse their own device. A ROCm build refuses e4m3fn (the marked
    decision in kernels/fp8.py) and under torchrun this process is a rank and asks torch."""
    from tree_attn.commands.run.setup import check_fp8_launch
    from tree_attn.errors import ConfigError, KernelUnavailableError
    from tree_attn.kernels import device_info, fp8
    from tree_attn.launch.env import RankEnv
    from tree_attn.launch.setup import LaunchSetup

    def gpu_ranks(world: int, kv_dtype: str = "fp8", **kw) -> LaunchSetup:
        return LaunchSetup(world_size=world, device_kind="cuda", backend="nccl", dtype="bf16", kv_dtype=kv_dtype, **kw)

    monkeypatch.setattr(device_info, "is_rocm", lambda: False)

    one, two = gpu_ranks(1), gpu_ranks(2)
    check_fp8_launch(one)  # cuda:0 is the H100
    with pytest.raises(ConfigError, match="compute capability 8.9 or newer.*this one is 8.0"):
        check_fp8_launch(two)  # cuda:1 is the A100
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    check_fp8_launch(two)  # the L40S and the H100
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ConfigError, match="this one is 8.0"):
        check_fp8_launch(one)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    check_fp8_launch(one)  # unknown here: each rank checks its device when it prepares its step
    with pytest.raises(ConfigError, match="run on ROCm GPUs only"):  # known without a device
        check_fp8_launch(gpu_ranks(1, kv_dtype="fp8_fnuz"))

    rank = RankEnv(rank=0, world_size=1, backend="nccl", device="cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="this one is 8.0"):
        check_fp8_launch(gpu_ranks(1, torchrun=rank))

    monkeypatch.setattr(device_info, "is_rocm", lambda: True)
    with pytest.raises(ConfigError, match="not supported on ROCm GPUs.*float8_e4m3fnuz"):
        check_fp8_launch(two)
    monkeypatch.setattr(fp8, "_conversion_error", lambda dtype: "RuntimeError: no kernel")
    with pytest.raises(KernelUnavailableError, match="cannot convert torch.float8_e4m3fn on CPU"):
        check_fp8_launch(LaunchSetup(world_size=1, device_kind="cpu", dtype="fp32", kv_dtype="fp8"))
