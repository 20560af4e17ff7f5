"""Peak memory of a region of code, per rank.

On GPUs: ``torch.cuda.max_memory_allocated`` (bytes held by tensors), reset at the start.
On CPU ranks torch keeps no allocator statistics, so a background thread samples this process's
resident set size (``/proc/self/statm``) every half millisecond; the result is the peak RSS of the
whole process (interpreter, torch and the KV shard included) and the peak above the RSS at the
start of the region. Large tensors are mmap-backed and returned to the OS when freed, so the
samples follow tensor allocations closely.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def available_host_bytes() -> int | None:
    """Memory the OS can give without swapping (``MemAvailable`` of /proc/meminfo), else the free
    physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * _PAGE
    except (AttributeError, ValueError, OSError):
        return None


def current_rss_bytes() -> int:
    """Resident set size of this process in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


@dataclass
class PeakMemory:
    """``peak_bytes``: peak during the region; ``start_bytes``: usage when it began."""

    peak_bytes: int = 0
    start_bytes: int = 0

    @property
    def above_start_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)


class MemoryMonitor:
    """Context manager measuring peak memory on ``device`` ("cpu" or "cuda:N")."""

    def __init__(self, device: str, interval_s: float = 0.0005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.result = PeakMemory()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MemoryMonitor:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.result.start_bytes = self.result.peak_bytes = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = current_rss_bytes()
            if rss > self.result.peak_bytes:
                self.result.peak_bytes = rss
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            self.result.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.result.peak_bytes = max(self.result.peak_bytes, current_rss_bytes())
