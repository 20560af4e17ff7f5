"""Timing that measures the device, not Python.

On a GPU an eager call's wall time is mostly the host issuing it (about 110 us of Python per
Triton decode call on an H100, against 10-100 us of kernel): timing a host clock around one call,
as ``tune`` once did, ranks configs by noise. So:

- the device time of a call is taken from CUDA events around a CUDA graph of many back-to-back
  calls, replayed several times (a replay issues the whole graph at once, so the GPU never waits
  for the host); the median over replays, divided by the calls per graph;
- the calls rotate over several input buffers totalling at least 3x the L2 cache, so no call
  reads what the previous one left in L2;
- before the start event the stream is held by a spin kernel while the host issues the timed
  work, so the events bracket device work only (not a graph's launch latency);
- the host's issue time per eager call is measured too;
- where capture fails, events around back-to-back eager calls, the stream held for as long as
  issuing them takes; where it cannot be held, a timing whose host time comes near its device
  time is flagged (``host_bound``): it would be the host's clock, not the device's.

On CPU tensors (Triton's interpreter, CPU ranks) the host clock is the device's: ``method`` says
``host-clock``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .graphs import settle_rng_after_failed_capture

# At least this many bytes of rotated inputs, in multiples of the L2 cache, so calls stream from DRAM.
L2_MULTIPLE = 3

# An eager timing is host-bound when issuing a call takes at least this fraction of its measured
# time (the measured time of a host-bound loop is the host's, slightly more: never below it).
HOST_BOUND_MARGIN = 0.8

# Before the start event, the stream is held busy this long (a spin kernel) so that the whole
# timed work is queued behind it: the events then bracket device work only, not the host's time
# to issue the first launch or a graph's launch latency.
HOLD_US = 50.0


@dataclass(frozen=True)
class CallTiming:
    """One callable's timing.

    Attributes:
        device_us: median device time of one call (``method`` says how it was taken).
        host_us: host time to issue one eager call (the Python and launch overhead).
        method: "cuda-graph" (events around graph replays), "cuda-events" (events around eager
            back-to-back calls) or "host-clock" (CPU).
        samples: how many medians' worth of repeats were taken.
        held: the timed work was queued behind a spin kernel that outlasted its issuing, so the
            events saw device work only, even for eager calls (see :func:`hold_stream`).
    """

    device_us: float
    host_us: float
    method: str
    samples: int
    held: bool = False

    @property
    def host_bound(self) -> bool:
        """True when the host may have been the clock. With eager calls between events the GPU
        runs at most as fast as the host issues: the measured time is about max(device, host), so
        a host that issues at close to the measured rate (within :data:`HOST_BOUND_MARGIN`) may
        have made the GPU wait, and the time may be Python's. Graph replays, and eager calls
        issued while the stream was held, are never flagged."""
        return self.method == "cuda-events" and not self.held and self.host_us >= HOST_BOUND_MARGIN * self.device_us


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
    hold: bool = True,
) -> CallTiming:
    """Time one call, where ``calls[i]`` is the same work over input set ``i`` (rotated).

    Args:
        calls: callables doing one launch each (their inputs already allocated, nothing
            allocated inside on GPUs when captured).
        repeats: samples (graph replays, or batches of eager calls); the median is reported.
        calls_per_sample: calls per sample (default: every input set once; on GPUs at least 10).
        use_graph: on GPUs, capture the calls as a graph (False: eager calls between events).
        hold: queue the timed work behind a spin kernel (:func:`hold_stream`), so the events see
            device work only. False for eager calls timed as a caller runs them: the GPU then
            waits whenever the host issues slower than it computes, and the time shows it.
    """
    device = torch.device(device)
    # On GPUs at least 10 calls per sample (a replay's or an event pair's fixed cost spread thin);
    # a host clock has no such cost (and under Triton's interpreter each call takes milliseconds).
    per_sample = calls_per_sample or (max(10, len(calls)) if device.type == "cuda" else len(calls))
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
    # Hold the stream while the host issues: a graph replay (one launch), or every eager call
    # with room to spare, so the events bracket back-to-back device work only.
    hold_us = HOLD_US if graph is not None else HOLD_US + 1.5 * host_us * per_sample
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    held = hold
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        if hold:
            held = hold_stream(device, hold_us) and held
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
        method="cuda-graph" if graph is not None else "cuda-events", samples=repeats, held=held,
    )


def _host_issue_us(sequence: Sequence[Callable[[], object]], device: torch.device, passes: int = 3) -> float:
    """Host time per eager call: the issue loop alone, the device drained before and after each
    pass; the median of ``passes``."""
    per_call = []
    for _ in range(passes):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for fn in sequence:
            fn()
        per_call.append((time.perf_counter() - t0) / len(sequence) * 1e6)
        torch.cuda.synchronize(device)
    return statistics.median(per_call)


def hold_stream(device: torch.device | str, us: float = HOLD_US) -> bool:
    """Queue a spin kernel of about ``us`` microseconds on the current stream, so that work the
    host issues next waits behind it instead of starting as each launch arrives (see
    :data:`HOLD_US`), as benchmark harnesses' "blocking kernel" does. The cycle count comes from
    the device's clock rate (2 GHz assumed where torch does not report it: then a longer spin
    on a slower clock, never a shorter one on these GPUs). False: no ``torch.cuda._sleep`` here,
    nothing queued."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return False
    rate_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000
    sleep(int(us * rate_khz / 1e3))
    return True


def _capture(sequence: Sequence[Callable[[], object]], device: torch.device):
    """A CUDA graph of the calls in order, or None if they cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        # A stream of this device: torch's default capture stream belongs to whichever device was
        # current when it was first made.
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            for fn in sequence:
                fn()
    except Exception:  # noqa: BLE001 - the caller falls back to eager calls between events
        settle_rng_after_failed_capture(device)  # else every later random op on the device raises
        torch.cuda.synchronize(device)
        return None
    return graph


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), the practical
    ceiling of a kernel that streams its input once: median of ``repeats`` copies between events.

    The copy is an elementwise kernel (``torch.neg(src, out=dst)``), run by the SMs as our kernels
    are, not ``dst.copy_(src)``: captured in a CUDA graph that becomes a memcpy node served by the
    copy engines, measured at 2.71 TB/s on an H200 against 4.25 TB/s for the kernel (and 4.23 TB/s
    for an eager ``copy_``), which made kernels look faster than the card's copy."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("copy bandwidth is measured on GPUs only")
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(nbytes, int(0.2 * free))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    timing = time_calls([lambda: torch.neg(src, out=dst)], device, repeats=repeats, warmup=2, calls_per_sample=5)
    return 2 * src.numel() * 4 / (timing.device_us * 1e-6) / 1e9
