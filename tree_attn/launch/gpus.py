"""What the launching process may learn of the GPUs its ranks will use, without making a CUDA
context: NVML's answers for the GPUs CUDA may use.

The launching process must not initialise CUDA (``torch.cuda.get_device_capability`` and the like
do): a context there would cost rank 0 about 0.5 GB on GPU 0, and fail under exclusive-process
compute mode. NVML makes none.

Which NVML device a CUDA index names: ``CUDA_VISIBLE_DEVICES`` narrows and orders the GPUs (by
index or ``GPU-<uuid>``), and the indices follow PCI bus order, NVML's, under
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (the CLI sets it unless the user chose otherwise). Under another
order the mapping is unknown, so a per-device answer is given only where every visible GPU answers
alike. No NVML (no driver binding, ROCm) or a query it refuses: None, and the caller says so or
leaves the check to the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["gpu_capabilities", "gpu_free_bytes", "visible_nvml_handles"]


def visible_nvml_handles(pynvml) -> list:
    """NVML handles of the GPUs CUDA may use (``CUDA_VISIBLE_DEVICES`` by index or UUID), in its order."""
    count = pynvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    handles = []
    for item in (v.strip() for v in visible.split(",") if v.strip()):
        if item.lstrip("-").isdigit():
            index = int(item)
            if not 0 <= index < count:
                break  # CUDA stops at the first invalid entry
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(index))
        else:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(item))
    return handles


def _ask_nvml(query: Callable[[Any, Any], Any]) -> list | None:
    """``query(pynvml, handle)`` for each visible GPU, in CUDA's order; None where NVML cannot answer."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no device: unknown
        return None
    try:
        return [query(pynvml, h) for h in visible_nvml_handles(pynvml)]
    except Exception:  # noqa: BLE001 - a MIG UUID, an unsupported query: unknown
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - shutting down a library that answered is best effort
            pass


def gpu_free_bytes() -> int | None:
    """The least free memory among the visible GPUs (every rank is held to it: which NVML device a
    CUDA index names depends on ``CUDA_DEVICE_ORDER``), or None where NVML cannot answer."""
    frees = _ask_nvml(lambda nvml, h: int(nvml.nvmlDeviceGetMemoryInfo(h).free))
    return min(frees) if frees else None


def gpu_capabilities() -> list[tuple[int, int]] | None:
    """The CUDA compute capability of each visible GPU, as ``cuda:i`` numbers them; None where
    NVML cannot answer, or where the order is not PCI bus order and the GPUs differ."""
    caps = _ask_nvml(lambda nvml, h: tuple(int(x) for x in nvml.nvmlDeviceGetCudaComputeCapability(h)))
    if not caps:
        return None
    if os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID" and len(set(caps)) > 1:
        return None
    return caps
