"""Memory of a job's ranks: what the host can give before a launch (:func:`available_host_bytes`,
:func:`check_host_memory`: a job of CPU ranks that cannot fit is refused before any rank
allocates), the peak memory of a region of code inside a rank (:class:`MemoryMonitor`), and how
freed host memory goes back to the OS (:func:`set_malloc_mmap_threshold`).

Peak memory. On GPUs: ``torch.cuda.max_memory_allocated`` (bytes held by tensors), reset at the start.
On CPU ranks torch keeps no allocator statistics, so the process's resident set size is used: the
result is the peak RSS of the whole process (interpreter, torch and the KV shard included) and the
peak above the RSS at the start of the region. The RSS follows tensor allocations closely only where
freed tensors go back to the OS: with glibc's default (dynamic) mmap threshold, tensors of up to
32 MiB come from the heap after the first such block is freed, and freed heap blocks stay resident
(:func:`set_malloc_mmap_threshold` says why and fixes it for a region).

- On Linux the kernel keeps the peak itself: writing "5" to ``/proc/self/clear_refs`` resets the
  high-water mark (``VmHWM`` in ``/proc/self/status``) to the current RSS, and reading it after the
  region gives the exact peak, with no cost inside the region.
- Elsewhere a background thread samples the RSS every half millisecond. That thread competes with
  the ranks for the cores: on a 2-core machine with 2 ranks it added 4-6 ms (20-25%) to a 17 ms
  decode step, which is why the high-water mark is used wherever it exists.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``), which counts
    kiB, in bytes; None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_host_bytes() -> int | None:
    """Memory the OS can give without swapping (``MemAvailable`` of /proc/meminfo), else the free
    physical pages; None where neither is known."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return avail
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * _PAGE
    except (AttributeError, ValueError, OSError):
        return None


def check_host_fits(need: int, refusal: Callable[[float, float], str]) -> None:
    """Refuse a job of CPU ranks that needs more host memory than is available, before any rank
    allocates it: a ConfigError of ``refusal(need GiB, available GiB)``. Unknown memory passes."""
    have = available_host_bytes()
    if have is not None and need > have:
        raise ConfigError(refusal(need / 2**30, have / 2**30))


# Per CPU process: the interpreter and torch (the peak-memory caption measures about 240 MiB).
PROCESS_BYTES = 300 * 2**20


def host_bytes_needed(world_size: int, seq_len: int, batch: int, kv_heads: int, head_dim: int, dtype: str,
                      ring: bool, q_heads: int = 0, kv_dtype: str | None = None) -> int:
    """Host memory a run of CPU ranks needs, roughly: per rank its K and V shard (made in
    float32, then cast to ``dtype``, and for an fp8 ``kv_dtype`` quantized: 1 byte per element
    more), ring's shards in flight (two more, in the KV dtype), the query and a few float32 states
    of ``[B, Hq, D + 1]`` (output, messages, merges: counted as 8), and a process; the parent's
    reference holds one shard (float32) at a time and the same states."""
    from ..dtypes import itemsize

    elem = itemsize(dtype)
    kv_elem = elem if kv_dtype is None else itemsize(kv_dtype)
    made = elem if kv_elem != elem else 0  # the unquantized shard, beside the quantized one
    shard = batch * -(-seq_len // world_size) * kv_heads * head_dim  # elements of K (or V) on one rank
    states = batch * q_heads * (head_dim * elem + 8 * 4 * (head_dim + 1))
    per_rank = 2 * shard * (4 + made + kv_elem * (3 if ring else 1)) + states + PROCESS_BYTES
    parent = 2 * shard * 4 + states + PROCESS_BYTES
    return world_size * per_rank + parent


def check_host_memory(world_size: int, seq_len: int, batch: int, kv_heads: int, head_dim: int, dtype: str,
                      ring: bool, q_heads: int = 0, kv_dtype: str | None = None) -> None:
    """Refuse a run of CPU ranks whose KV cache cannot fit in this machine's available memory,
    before any rank allocates it."""
    need = host_bytes_needed(world_size, seq_len, batch, kv_heads, head_dim, dtype, ring, q_heads, kv_dtype)
    check_host_fits(need, lambda need_gib, have_gib: (
        f"--seq-len {seq_len:,} (batch {batch}, {q_heads or '?'}/{kv_heads} heads, head dim {head_dim}, {dtype}) "
        f"over {world_size} CPU ranks needs about {need_gib:,.1f} GiB (K and V shards, "
        f"{'ring shards in flight, ' if ring else ''}query and states, one process each); this machine has "
        f"{have_gib:,.1f} GiB available: use a smaller --seq-len, --batch or --heads"))


# glibc's mallopt(3) parameters (malloc.h) and its defaults: the mmap threshold starts at 128 KiB
# and, dynamically, rises up to 32 MiB (64-bit); the heap's top is trimmed beyond twice it.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MIN = 128 * 1024
MMAP_THRESHOLD_MAX = 32 * 2**20


def set_malloc_mmap_threshold(threshold: int) -> bool:
    """Make this process's malloc serve every allocation of ``threshold`` bytes or more by an mmap
    of its own (unmapped, i.e. returned to the OS, when freed), and trim the heap's top beyond
    ``2 x threshold``. glibc only (``mallopt``); elsewhere nothing is done and False is returned.

    Why: by default glibc raises its mmap threshold to the size of every mmapped block freed, up
    to 32 MiB. From then on, blocks below that come from the heap, and a freed heap block stays
    resident unless it lies at the heap's top. A prefill allocates and frees token-sized tensors
    in every layer, so what stays resident depends on their exact sizes (the keys of 8,191 tokens,
    1,024 float32 each, are just under 32 MiB and raise the threshold; those of 8,192 tokens are
    not): in ``generate``'s sharded prefill the last rank, one token short, kept 80 MiB (16K-token
    prompt, 2 ranks) to 170 MiB (32K) more resident than rank 0, through its prefill and its
    decode (benchmarks/RESULTS.md). With a fixed threshold of
    :data:`MMAP_THRESHOLD_MIN` they go back when freed, and the RSS is what the tensors hold.
    A fixed threshold also stops the dynamic one: set it again to change it.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # musl's mallopt does nothing; macOS has none
            return False
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold))) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * int(threshold)))


def _high_water_bytes() -> int | None:
    """``VmHWM`` of this process in bytes, or None where /proc/self/status lacks it."""
    return _proc_kib("/proc/self/status", "VmHWM")


def _reset_high_water() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _high_water_bytes() is not None


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
        self._high_water = False
        #: How the CPU peak was taken: "high-water mark" (exact) or "sampled" (a thread).
        self.method = "cuda allocator" if device.startswith("cuda") else ""

    def __enter__(self) -> Self:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self._high_water = _reset_high_water()
            self.result.start_bytes = self.result.peak_bytes = current_rss_bytes()
            self.method = "high-water mark" if self._high_water else "sampled"
            if not self._high_water:
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = current_rss_bytes()
            self.result.peak_bytes = max(self.result.peak_bytes, rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            self.result.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self._high_water:
            self.result.peak_bytes = max(self.result.peak_bytes, _high_water_bytes() or 0, current_rss_bytes())
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.result.peak_bytes = max(self.result.peak_bytes, current_rss_bytes())
