"""Cached facts about the device a launch runs on (querying device properties costs microseconds,
and the launcher asks on every decode step)."""

from __future__ import annotations

import functools

import torch

from ..cost.devices import CPU_INTERPRETER, DeviceSpec
from ..cost.probe import probe_device_spec


def is_rocm() -> bool:
    """True on a ROCm build of torch (AMD GPUs appear as device type "cuda" there)."""
    return getattr(torch.version, "hip", None) is not None


@functools.cache
def _spec_for_index(index: int) -> DeviceSpec:
    return probe_device_spec(index)


def device_spec_for(device: torch.device) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device``; :data:`CPU_INTERPRETER` for CPU tensors."""
    if device.type != "cuda":
        return CPU_INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _spec_for_index(index)
