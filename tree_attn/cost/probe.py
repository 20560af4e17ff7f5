"""A live device's :class:`~tree_attn.cost.devices.DeviceSpec`, read through torch: the one module
of the cost models that imports torch (``kernels.device_info`` caches its answers per device)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .devices import CPU_INTERPRETER, DeviceSpec, lookup_known_device


def probe_device_spec(device: Any = None) -> DeviceSpec:
    """Spec of a torch device: a known card's datasheet numbers, with the SM count and L2 size
    the driver reports; for an unknown card, what the driver reports and assumed latencies.

    ``device``: a ``torch.device``, an index, a string such as ``"cuda:1"``, or ``None`` for the
    current CUDA/ROCm device. A CPU device gives :data:`CPU_INTERPRETER`.
    """
    dev = torch.device(device) if device is not None and not isinstance(device, int) else None
    if dev is not None and dev.type != "cuda":
        return CPU_INTERPRETER
    if not torch.cuda.is_available():
        return CPU_INTERPRETER
    index = device if isinstance(device, int) else (dev.index if dev is not None and dev.index is not None
                                                     else torch.cuda.current_device())
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
    return DeviceSpec(
        name=name,
        vendor="amd" if amd else "nvidia",
        sm_count=sm,
        mem_bandwidth_gbps=gbps,
        bandwidth_source=source,
        l2_bytes=l2,
        smem_per_sm_bytes=int(getattr(props, "shared_memory_per_multiprocessor", 0)
                              or (64 * 1024 if amd else 100 * 1024)),
        max_warps_per_sm=max(1, max_threads // warp),
        warp_size=warp,
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 0) or 65536),
        mem_latency_ns=800.0 if amd else 650.0,
        tensor_tflops=300.0,
        launch_gap_us=4.0 if amd else 2.5,
    )
