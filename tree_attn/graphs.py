"""A decode step on static buffers, captured once as a CUDA graph and replayed.

An eager decode step costs what Python spends issuing it: about 110 us of host time per Triton
decode call was measured on an H100, while the kernel itself needs 10-100 us. A CUDA graph records
the step's kernels (and NCCL's) once; a replay issues them all with one call, so the step costs
what the GPU spends. The step must read and write only tensors that outlive the graph (the caller
updates inputs in place between replays), must not allocate on the host or sync, and must issue
the same work every time: exactly what a prepared step does.

On CPU tensors there is nothing to capture: :class:`CapturedStep` then runs the step eagerly.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch


class CapturedStep:
    """Run ``fn()`` as a CUDA graph replay on ``device`` (eagerly on CPU, or when asked not to).

    Args:
        fn: the step; reads and writes static tensors only; returns its outputs (static tensors).
        device: where it runs.
        enabled: capture at all (False: every call runs ``fn`` eagerly).
        warmup: eager runs before capture, on a side stream, as capture requires: they compile
            the Triton kernels and create NCCL communicators, which must not happen during capture.

    A step that talks to other ranks makes this constructor collective: every rank must build its
    CapturedStep at the same point of the program (the warm-up runs communicate).

    If capture fails (a kernel that cannot be captured), a warning says why and the step runs
    eagerly: the same results, host-bound timing. ``captured`` says which happened and
    ``why_eager`` why not. A step that communicates (``communicates=True``) does not fall back:
    a capture that failed inside an NCCL group call can leave the group open, and later calls on
    that process group would then hang or misbehave; the error is raised, with the way around it.

    Call :meth:`close` (or use the owning step as a context manager) when done: NCCL's teardown
    waits for every graph that holds one of its kernels, so a graph still alive at
    ``destroy_process_group`` (kept by a traceback, say) hangs it.
    """

    def __init__(
        self, fn: Callable[[], Any], device: torch.device, *, enabled: bool = True, warmup: int = 2,
        communicates: bool = False,
    ) -> None:
        self.fn = fn
        self.communicates = communicates
        self.closed = False
        self.device = torch.device(device)
        self.graph = None
        self.outputs: Any = None
        self.why_eager: str | None = None
        if not enabled:
            self.why_eager = "CUDA graphs turned off"
        elif self.device.type != "cuda":
            self.why_eager = f"{self.device.type} tensors: nothing to capture"
        else:
            self._capture(warmup)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _capture(self, warmup: int) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                self.fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a watchdog or monitor thread touching CUDA while we capture must not
            # invalidate the capture (the default "global" mode forbids any thread's unsafe calls).
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                self.outputs = self.fn()
        except Exception as exc:  # noqa: BLE001 - reported, then the step runs eagerly
            if self.communicates:
                from .errors import DistributedError

                raise DistributedError(
                    f"capturing the decode step as a CUDA graph failed ({type(exc).__name__}: {exc}); the step "
                    "talks to other ranks, so it is not retried eagerly on the same process group. Run it "
                    "without graphs (`--no-cuda-graph`, or cuda_graph=False)"
                ) from exc
            torch.cuda.synchronize(self.device)
            self.why_eager = f"capture failed ({type(exc).__name__}: {exc})"
            warnings.warn(f"CUDA graph {self.why_eager}; running the step eagerly", RuntimeWarning, stacklevel=3)
            self.outputs = None
            return
        self.graph = graph

    def __call__(self) -> Any:
        """One step: replay the graph (or run ``fn`` eagerly); returns the step's outputs."""
        if self.closed:
            raise RuntimeError("this decode step was closed; build a new one")
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs

    def close(self) -> None:
        """Wait for the device, then free the graph (and the NCCL kernels it holds). Idempotent."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None
        self.outputs = None
        self.closed = True


class StaticStep:
    """Base of the static-buffer steps (``DecodeStep``, ``TreeDecodeStep``): ``self.graph`` is
    their :class:`CapturedStep`."""

    graph: CapturedStep

    @property
    def captured(self) -> bool:
        """Whether each step is a graph replay."""
        return self.graph.captured

    @property
    def why_eager(self) -> str | None:
        """Why the step runs eagerly (None when it is captured)."""
        return self.graph.why_eager

    def close(self) -> None:
        """Free the step's CUDA graph (see :meth:`CapturedStep.close`); the step cannot run after."""
        self.graph.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
