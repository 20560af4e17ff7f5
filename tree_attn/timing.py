"""Timing that measures the device, not Python.

On a GPU an eager call's wall time is mostly the host issuing it (about 110 us of Python per
Triton decode call on an H100, against 10-100 us of kernel): timing a host clock around one call,
as ``tune`` once did, ranks configs by noise. So:

- the device time of a call is taken from CUDA events around a CUDA graph of many back-to-back
  calls, replayed several times (a replay issues the whole graph at once, so the GPU never waits
  for the host); the median over replays, divided by the calls per graph;
- the calls rotate over several input buffers totalling at least 3x the L2 cache, so no call
  reads what the previous one left in L2;
- the host's issue time per eager call is measured too, and a timing whose host time reaches its
  device time is flagged (``host_bound``): it would be the host's clock, not the device's;
- where capture fails, events around back-to-back eager calls, with the same flag.

On CPU tensors (Triton's interpreter, CPU ranks) the host clock is the device's: ``method`` says
``host-clock``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# At least this many bytes of rotated inputs, in multiples of the L2 cache, so calls stream from DRAM.
L2_MULTIPLE = 3


@dataclass(frozen=True)
class CallTiming:
    """One callable's timing.

    Attributes:
        device_us: median device time of one call (``method`` says how it was taken).
        host_us: host time to issue one eager call (the Python and launch overhead).
        method: "cuda-graph" (events around graph replays), "cuda-events" (events around eager
            back-to-back calls) or "host-clock" (CPU).
        samples: how many medians' worth of repeats were taken.
    """

    device_us: float
    host_us: float
    method: str
    samples: int

    @property
    def host_bound(self) -> bool:
        """True when issuing a call takes the host as long as the device runs it: with eager
        events the GPU then idles between calls, and the timing measures Python."""
        return self.method == "cuda-events" and self.host_us >= self.device_us


def rotation_count(bytes_per_input: int, l2_bytes: int, free_bytes: int, *, cap: int = 256) -> int:
    """How many input sets to rotate over: enough for ``L2_MULTIPLE`` x L2, within 40% of free
    memory, at most ``cap``; at least 1 (then an input larger than L2 streams anyway)."""
    need = -(-L2_MULTIPLE * max(l2_bytes, 1) // max(bytes_per_input, 1)) + 1
    fit = int(0.4 * free_bytes // max(bytes_per_input, 1))
    return max(1, min(need, fit, cap))


def time_calls(
    calls: Sequence[Callable[[], object]],
    device: torch.device | str,
    *,
    repeats: int = 20,
    warmup: int = 3,
    calls_per_sample: int | None = None,
    use_graph: bool = True,
) -> CallTiming:
    """Time one call, where ``calls[i]`` is the same work over input set ``i`` (rotated).

    Args:
        calls: callables doing one launch each (their inputs already allocated, nothing
            allocated inside on GPUs when captured).
        repeats: samples (graph replays, or batches of eager calls); the median is reported.
        calls_per_sample: calls per sample (default: every input set at least once, at least 10).
        use_graph: on GPUs, capture the calls as a graph (False: eager calls between events).
    """
    device = torch.device(device)
    per_sample = calls_per_sample or max(10, len(calls))
    sequence = [calls[i % len(calls)] for i in range(per_sample)]
    for _ in range(warmup):
        for fn in calls:
            fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for fn in sequence:
                fn()
            samples.append((time.perf_counter() - t0) / per_sample * 1e6)
        med = statistics.median(samples)
        return CallTiming(device_us=med, host_us=med, method="host-clock", samples=repeats)

    host_us = _host_issue_us(sequence, device)
    graph = _capture(sequence, device) if use_graph else None
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for fn in sequence:
                fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per_sample)
    return CallTiming(
        device_us=statistics.median(samples), host_us=host_us,
        method="cuda-graph" if graph is not None else "cuda-events", samples=repeats,
    )


def _host_issue_us(sequence: Sequence[Callable[[], object]], device: torch.device) -> float:
    """Host time per eager call: the issue loop alone, the device drained before and after."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for fn in sequence:
        fn()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return issued / len(sequence) * 1e6


def _capture(sequence: Sequence[Callable[[], object]], device: torch.device):
    """A CUDA graph of the calls in order, or None if they cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for fn in sequence:
                fn()
    except Exception:  # noqa: BLE001 - the caller falls back to eager calls between events
        torch.cuda.synchronize(device)
        return None
    return graph


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), the practical
    ceiling of a kernel that streams its input once: median of ``repeats`` copies between events."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("copy bandwidth is measured on GPUs only")
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(nbytes, int(0.2 * free))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    timing = time_calls([lambda: dst.copy_(src)], device, repeats=repeats, warmup=2, calls_per_sample=5)
    return 2 * src.numel() * 4 / (timing.device_us * 1e-6) / 1e9
