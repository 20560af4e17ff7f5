"""The CPU peak-memory monitor that `run` wraps its timed steps in (CPU ranks).

A tensor allocated and freed inside the region must show in the peak, both through the kernel's
high-water mark (Linux) and through the sampling thread used where that mark is missing.
"""

import contextlib
import gc
import sys
import time

import pytest
import torch

from tree_attn.runner import memory
from tree_attn.runner.memory import MemoryMonitor

MIB = 2**20


@contextlib.contextmanager
def _no_collection():
    """Earlier tests' garbage collected first, and no collection inside the block: a collection
    freeing tens of MiB inside a monitored region would lower the resident size under the region's
    own allocation, and its peak would then not rise above the start (seen once in CI)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _touch_and_free(nbytes: int, hold_s: float = 0.0) -> None:
    """Allocate ``nbytes`` (above 32 MiB: mmap-backed, fresh pages), write them all, free them."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)  # written, so every page is resident
    if hold_s:
        time.sleep(hold_s)
    del t


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's")
def test_high_water_mark_sees_a_freed_allocation():
    with _no_collection(), MemoryMonitor("cpu") as mon:
        _touch_and_free(128 * MIB)
    assert mon.method == "high-water mark"
    assert mon.result.above_start_bytes >= 120 * MIB
    assert mon.result.peak_bytes >= mon.result.start_bytes + 120 * MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's")
def test_high_water_mark_is_reset_at_the_start():
    # Sizes above glibc's largest mmap threshold (32 MiB): fresh pages, never reused heap memory.
    _touch_and_free(320 * MIB)  # a peak before the region must not count in it
    with _no_collection(), MemoryMonitor("cpu") as mon:
        _touch_and_free(64 * MIB)
    assert mon.method == "high-water mark"
    assert 60 * MIB <= mon.result.above_start_bytes < 250 * MIB


def test_sampling_fallback_sees_a_held_allocation(monkeypatch):
    monkeypatch.setattr(memory, "_reset_high_water", lambda: False)
    with MemoryMonitor("cpu") as mon:
        _touch_and_free(128 * MIB, hold_s=0.05)
    assert mon.method == "sampled"
    assert mon.result.above_start_bytes >= 120 * MIB
