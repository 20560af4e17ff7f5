"""The CPU peak-memory monitor that `run` wraps its timed steps in (CPU ranks).

Memory mapped, written and freed inside the region must show in the peak, both through the kernel's
high-water mark (Linux) and through the sampling thread used where that mark is missing.
"""

import mmap
import sys
import time

import pytest

from tree_attn.launch import memory
from tree_attn.launch.memory import MemoryMonitor

MIB = 2**20


def _touch_and_free(nbytes: int, hold_s: float = 0.0) -> None:
    """Map ``nbytes`` of fresh anonymous memory, write a byte on every page (so each becomes
    resident), unmap it. A mapping of its own always adds to the resident size, where a tensor's
    memory may come from pages the allocator already holds (seen in a full-suite run: the region's
    64 MiB tensor left the resident size where it was, and the peak read 0 above the start)."""
    buf = mmap.mmap(-1, nbytes)
    try:
        for offset in range(0, nbytes, mmap.PAGESIZE):
            buf[offset] = 1
        if hold_s:
            time.sleep(hold_s)
    finally:
        buf.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's")
def test_high_water_mark_sees_a_freed_allocation():
    with MemoryMonitor("cpu") as mon:
        _touch_and_free(128 * MIB)
    assert mon.method == "high-water mark"
    assert mon.result.above_start_bytes >= 120 * MIB
    assert mon.result.peak_bytes >= mon.result.start_bytes + 120 * MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the high-water mark is Linux's")
def test_high_water_mark_is_reset_at_the_start():
    # Fresh anonymous mappings: pages never reused from earlier allocations.
    _touch_and_free(320 * MIB)  # a peak before the region must not count in it
    with MemoryMonitor("cpu") as mon:
        _touch_and_free(64 * MIB)
    assert mon.method == "high-water mark"
    assert 60 * MIB <= mon.result.above_start_bytes < 250 * MIB


def test_sampling_fallback_sees_a_held_allocation(monkeypatch):
    monkeypatch.setattr(memory, "_reset_high_water", lambda: False)
    with MemoryMonitor("cpu") as mon:
        _touch_and_free(128 * MIB, hold_s=0.05)
    assert mon.method == "sampled"
    assert mon.result.above_start_bytes >= 120 * MIB
