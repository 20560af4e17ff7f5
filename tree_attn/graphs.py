"""A decode step on static buffers, captured once as a CUDA graph and replayed.

An eager decode step costs what Python spends issuing it: about 110 us of host time per Triton
decode call was measured on an H100, while the kernel itself needs 10-100 us. A CUDA graph records
the step's kernels (and NCCL's) once; a replay issues them all with one call, so the step costs
what the GPU spends. The step must read and write only tensors that outlive the graph (the caller
updates inputs in place between replays), must not allocate on the host or sync, and must issue
the same work every time: exactly what a prepared step does.

On CPU tensors there is nothing to capture: :class:`CapturedStep` then runs the step eagerly.

Waiting for a replay is bounded. torch's NCCL watchdog times out the work objects the host issues;
a replay issues none (the sends, receives and all-reduces recorded during capture are replayed by
the GPU alone), so a replayed receive whose peer stalls without dying would block the stream, and
``torch.cuda.synchronize()`` with it, forever, while the rank's heartbeat thread kept beating.
:func:`wait_for` polls an event against a deadline instead and, on expiry, aborts the
communicator (so the NCCL kernels waiting on it return) and raises one line naming the rank and
the step. NCCL's abort itself waits until every graph holding its kernels is destroyed, so a
step gives up by freeing those graphs first (:meth:`CapturedStep.wait`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

# A wait polls its event without sleeping for this long, so a step's wall time is exact to the
# poll (a microsecond or so; a sleep of even 1 us costs ~50 us of timer slack on Linux), then
# sleeps POLL_SLEEP_S between polls: a step longer than a second is then timed to within 0.1%.
# (torch.cuda.synchronize spins the same way under CUDA's default scheduling.)
SPIN_S = 1.0
POLL_SLEEP_S = 1e-3

# Graphs dropped during another capture (where a device sync is illegal and would break that
# capture), freed by the next close or build outside a capture.
_DEFERRED: list = []
# Live steps whose graphs hold NCCL kernels. NCCL's abort waits until every graph holding one of
# its communicator's kernels is destroyed (ncclCommAbort -> commDestroySync polls until
# localPersistentRefs is 0), so before an abort they are all freed (see CapturedStep._give_up).
_COMMUNICATING: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def persistent_buffers():
    """Build what a prepared object keeps between calls (its buffers, a captured graph) here, as a
    ``with`` block or a decorator of its constructor.

    Tensors made inside ``torch.inference_mode`` are inference tensors, which torch refuses to
    update in place outside it ("Inplace update to inference tensor outside InferenceMode"), so an
    object built there (a ``DecodeStep``, or a cached one that ``decode_attention`` reuses) would
    fail at its next call outside. Built here, its buffers are normal tensors, which both modes
    may update; and nothing its construction computes records autograd history. Construction
    only: no per-call cost.
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


def wait_for(
    done, timeout_s: float | None, *, what: str, rank: int | None = None,
    abort: Callable[[], str] | None = None,
) -> None:
    """Block until ``done.query()`` is True, for at most ``timeout_s`` seconds.

    Args:
        done: a ``torch.cuda.Event`` recorded after the work (anything with ``query() -> bool``;
            ``synchronize()`` too when ``timeout_s`` is None).
        timeout_s: the longest wait in seconds; None waits without a bound.
        what: the work waited for, as the error names it (say "tree k=2 step 3 of 8").
        rank: this process's rank, named in the error (None: not named).
        abort: called once on expiry, before raising: aborts the communicator the work waits on
            so that its kernels return; returns a few words saying what it did.

    Raises:
        DistributedError: one line: the rank, the step, the timeout and what was aborted.
    """
    if timeout_s is None:
        done.synchronize()
        return
    start = time.monotonic()
    deadline = start + timeout_s
    while not done.query():
        now = time.monotonic()
        if now >= deadline:
            from .errors import DistributedError

            did = "nothing to abort" if abort is None else _call_abort(abort)
            who = "" if rank is None else f"rank {rank}: "
            raise DistributedError(
                f"{who}{what} did not finish within {timeout_s:g} s (a peer rank stopped or hung without failing?); "
                f"{did}. Check the other ranks, or raise the timeout (--timeout, timeout_s) if a step really takes "
                f"this long"
            )
        if now - start > SPIN_S:
            time.sleep(min(POLL_SLEEP_S, deadline - now))


def _call_abort(abort: Callable[[], str]) -> str:
    try:
        return abort() or "the communicator was aborted"
    except Exception as exc:  # noqa: BLE001 - the timeout is the error to report; say the abort failed
        return f"aborting the communicator failed too ({type(exc).__name__}: {' '.join(str(exc).split())})"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def free_communicating_graphs(why: str) -> int:
    """Free every live graph that holds NCCL kernels, without waiting for it (CUDA frees one still
    running once it ends), before its communicator is aborted or destroyed: NCCL waits for them
    all to be destroyed first. Their steps cannot run after (``why`` says so). Returns how many."""
    steps = list(_COMMUNICATING)
    for step in steps:
        step._drop(why)
    while _DEFERRED:
        _DEFERRED.pop()[1].reset()
    return len(steps)


def _free_deferred() -> None:
    """Free graphs dropped during another capture, now that no capture is running."""
    while _DEFERRED and not _capturing():
        device, graph = _DEFERRED.pop()
        torch.cuda.synchronize(device)
        graph.reset()


def settle_rng_after_failed_capture(device: torch.device) -> str:
    """Take the device's random-number state out of capture after a capture that failed.

    torch puts the default CUDA generator of the capturing device into capture mode when a
    capture begins, and takes it out only when ending the capture succeeds (torch 2.11's
    ``CUDAGraph::capture_end`` raises before the generator's epilogue when the capture was
    invalidated, e.g. by a sync). Left so, every later random op on the device (``torch.randn``)
    and every replay of any graph captured before fails with "Offset increment outside graph
    capture encountered unexpectedly" (seen on an H100, torch 2.11). A capture that succeeds
    runs the epilogue on the same shared state: one of a 1-cycle kernel, freed at once.

    Returns "" when settled, else a clause saying what may now fail (appended to the reason).
    """
    try:
        settle = torch.cuda.CUDAGraph()
        with torch.cuda.graph(settle, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            torch.cuda._sleep(1)
        settle.reset()
        return ""
    except Exception as exc:  # noqa: BLE001 - any failure: the step still runs eagerly, and its reason says this
        return (f"; random numbers on {device} may fail from now on (settling the generator after the failed "
                f"capture failed too: {type(exc).__name__}: {exc})")


class CapturedStep:
    """Run ``fn()`` as a CUDA graph replay on ``device`` (eagerly on CPU, or when asked not to).

    Args:
        fn: the step; reads and writes static tensors only; returns its outputs (static tensors).
            It must not refer to the object that owns this CapturedStep (a bound method of it
            would make a reference cycle, and the graph would then live until the garbage
            collector runs, not until the step is dropped).
        device: where it runs.
        enabled: capture at all (False: every call runs ``fn`` eagerly).
        warmup: eager runs before capture, on a side stream, as capture requires: they compile
            the Triton kernels and create NCCL communicators, which must not happen during capture.
        communicates: the step talks to other ranks (see below).
        timeout_s: the longest :meth:`wait` (and :meth:`close`) waits for the step's work; None:
            no bound.
        abort: called when a wait times out, before the error is raised: aborts the communicator
            the step's NCCL kernels wait on, and returns a few words saying so.
        rank: this process's rank, named in a timeout's error.
        name: the step as errors name it.

    A step that talks to other ranks makes this constructor collective: every rank must build its
    CapturedStep at the same point of the program (the warm-up runs communicate).

    If capture fails (a kernel that cannot be captured), a warning says why and the step runs
    eagerly: the same results, host-bound timing. ``captured`` says which happened and
    ``why_eager`` why not. A step that communicates (``communicates=True``) does not fall back:
    a capture that failed inside an NCCL group call can leave the group open, and later calls on
    that process group would then hang or misbehave; the error is raised, with the way around it.
    Either way the stream that was current before is current again, and the device's random-number
    generator is out of capture mode (torch leaves it in when ending a capture fails).

    A call only issues the step; :meth:`wait` waits for it, at most ``timeout_s``. Call
    :meth:`close` (or use the owning step as a context manager) when done: NCCL's teardown waits
    for every graph that holds one of its kernels, so a graph still alive at
    ``destroy_process_group`` hangs it. Dropping the last reference closes it too, at once.
    """

    def __init__(
        self, fn: Callable[[], Any], device: torch.device, *, enabled: bool = True, warmup: int = 2,
        communicates: bool = False, timeout_s: float | None = None, abort: Callable[[], str] | None = None,
        rank: int | None = None, name: str = "the decode step",
    ) -> None:
        self.closed = True  # until built: __del__ of a half-built step has nothing to free
        self.graph = None
        self.fn = fn
        self.communicates = communicates
        self.timeout_s = timeout_s
        self.abort = abort
        self.rank = rank
        self.name = name
        self.calls = 0
        self.failed: str | None = None  # why the step cannot run again (a wait timed out)
        self.device = torch.device(device)
        self.outputs: Any = None
        self.why_eager: str | None = None
        self.closed = False
        if not enabled:
            self.why_eager = "CUDA graphs turned off"
        elif self.device.type != "cuda":
            self.why_eager = f"{self.device.type} tensors: nothing to capture"
        else:
            _free_deferred()
            self._capture(warmup)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _capture(self, warmup: int) -> None:
        # torch.cuda.graph's exit does not restore the stream when ending the capture raises (a
        # capture invalidated by an op that cannot be captured), nor does its entry when
        # beginning one fails: the side stream would stay current, and every later kernel of
        # this thread would run on it. So the streams are restored here on every path.
        here = torch.cuda.current_stream()  # the current device's (restored last: it stays current)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        try:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(max(1, warmup)):
                    self.fn()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a watchdog or monitor thread touching CUDA while we capture must
                # not invalidate the capture (the default "global" mode forbids any thread's
                # unsafe calls).
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    self.outputs = self.fn()
            except Exception as exc:  # reported, then the step runs eagerly
                unsettled = settle_rng_after_failed_capture(self.device)
                if self.communicates:
                    from .errors import DistributedError

                    raise DistributedError(
                        f"capturing the decode step as a CUDA graph failed ({type(exc).__name__}: {exc}); the step "
                        "talks to other ranks, so it is not retried eagerly on the same process group. Run it "
                        f"without graphs (`--no-cuda-graph`, or cuda_graph=False){unsettled}"
                    ) from exc
                torch.cuda.synchronize(self.device)
                self.why_eager = f"capture failed ({type(exc).__name__}: {exc}){unsettled}"
                warnings.warn(f"CUDA graph {self.why_eager}; running the step eagerly", RuntimeWarning, stacklevel=4)
                self.outputs = None
                return
            self.graph = graph
            if self.communicates:
                _COMMUNICATING.add(self)
        finally:
            torch.cuda.set_stream(current)
            torch.cuda.set_stream(here)

    def __call__(self) -> Any:
        """One step: replay the graph (or run ``fn`` eagerly); returns the step's outputs. The
        work is issued, not waited for: see :meth:`wait`."""
        if self.closed:
            raise RuntimeError("this decode step was closed; build a new one")
        if self.failed is not None:
            from .errors import DistributedError

            raise DistributedError(f"this decode step cannot run again: {self.failed}")
        self.calls += 1
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs

    def wait(self, what: str | None = None, *, done=None) -> None:
        """Wait for the step's work: ``done`` (an event recorded after it), else everything issued
        so far on the device's current stream (where the step replays), at most ``timeout_s``.

        On expiry the graph is freed (CUDA frees one still running once it ends), with every
        other live graph that holds NCCL kernels when this step communicates (NCCL's abort
        waits for them all), ``abort`` runs, and :class:`DistributedError` is raised: one line
        naming the rank and ``what``, by default this step and its call count. The step (and
        those others) cannot run after. CPU steps have finished when they return.
        """
        if self.device.type != "cuda":
            return
        if done is None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        wait_for(done, self.timeout_s, what=what or f"{self.name} (call {self.calls})", rank=self.rank,
                 abort=self._give_up)

    def _give_up(self) -> str:
        """A wait timed out: free the graphs the abort would wait for, then abort."""
        why = f"{self.name} timed out after {self.timeout_s:g} s and its communicator was aborted"
        self._drop(why)
        if self.communicates:
            free_communicating_graphs(f"{why} (that of this step too)")
        return self.abort() if self.abort is not None else "nothing to abort"

    def _drop(self, why: str) -> None:
        """Free the graph without waiting for it (a replay may still run: CUDA frees it once it
        ends); the step cannot run after."""
        self.failed = why
        graph, self.graph, self.outputs = self.graph, None, None
        _COMMUNICATING.discard(self)
        if graph is not None:
            graph.reset()

    def close(self) -> None:
        """Wait for the device (at most ``timeout_s`` for the current stream, as :meth:`wait`),
        then free the graph (and the NCCL kernels it holds). Idempotent; runs by itself when the
        step is dropped. A wait that times out here gives up as :meth:`wait` does."""
        if self.closed:
            return
        try:
            if self.graph is not None and _capturing():  # dropped inside another capture: no sync here
                _DEFERRED.append((self.device, self.graph))
            elif self.graph is not None:
                if self.timeout_s is not None:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(self.device))
                    wait_for(done, self.timeout_s, what=f"closing {self.name}", rank=self.rank, abort=self._give_up)
                torch.cuda.synchronize(self.device)  # the rest (other streams); quick after the wait
                self.graph.reset()
                _free_deferred()
        finally:
            self.closed = True
            _COMMUNICATING.discard(self)
            self.graph, self.outputs, self.fn = None, None, None

    def __del__(self) -> None:
        # The last reference went: free the graph now, not whenever the collector would run.
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - nowhere to report from a finaliser
            pass


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

    def wait(self, what: str | None = None, *, done=None) -> None:
        """Wait for the step's last call (or ``done``, an event recorded after it), at most the
        step's timeout (see :meth:`CapturedStep.wait`): on expiry the communicator is aborted and
        :class:`DistributedError` names the rank and the step."""
        self.graph.wait(what, done=done)

    def close(self) -> None:
        """Free the step's CUDA graph (see :meth:`CapturedStep.close`); the step cannot run after.
        Dropping the last reference to the step does the same."""
        self.graph.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
