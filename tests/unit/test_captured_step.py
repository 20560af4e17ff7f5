"""The mechanisms of ``graphs.CapturedStep`` that a CPU can hold: bounded waits on a replay (a
stand-in event that never completes), the step freed the moment its last reference goes (no
reference cycle, no garbage collector), and the current stream restored after a failed capture.

The CUDA calls are stand-ins (``fake_cuda``) that behave as torch's do where it matters: like
``torch.cuda.graph``, the stand-in capture sets the side stream current on entry and, when
ending the capture raises, leaves it current. The same paths on a real GPU are in
``tests/dist/test_replay_timeout_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from typing import ClassVar

import pytest
import torch

from tree_attn import graphs
from tree_attn.errors import DistributedError

CUDA0 = torch.device("cuda", 0)


class NeverDone:
    """An event whose work never completes (a replayed receive whose peer never sends)."""

    def __init__(self):
        self.polls = 0

    def record(self, stream=None):
        pass

    def query(self) -> bool:
        self.polls += 1
        return False

    def synchronize(self):
        raise AssertionError("an unbounded wait on work that never completes")


class DoneAfter(NeverDone):
    def __init__(self, polls: int):
        super().__init__()
        self.after = polls

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.after


class Abort:
    def __init__(self, fails: bool = False, log: list | None = None):
        self.calls = 0
        self.fails = fails
        self.log = log if log is not None else []

    def __call__(self) -> str:
        self.calls += 1
        self.log.append("abort")
        if self.fails:
            raise RuntimeError("ncclCommAbort failed\nsecond line")
        return "the stand-in communicator was aborted"


def _bounded(fn, limit_s: float = 30.0):
    """Run ``fn`` in a thread; fail (not hang) if it does not return within ``limit_s``.
    Returns what it returned or raised."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still waiting after {limit_s} s: the wait is not bounded"
    return box


def test_a_wait_on_work_that_never_completes_ends_at_its_deadline_with_one_line():
    """The replay's event never completes: the wait gives up at the deadline (not before: a slow
    healthy step is not cut short), aborts the communicator once, and raises one line naming
    the rank and the step."""
    done, abort = NeverDone(), Abort()
    t0 = time.monotonic()
    box = _bounded(lambda: graphs.wait_for(done, 0.3, what="tree k=2 step 3 of 8", rank=1, abort=abort))
    elapsed = time.monotonic() - t0
    err = box.get("error")
    assert isinstance(err, DistributedError), box
    text = str(err)
    assert "\n" not in text
    assert text.startswith("rank 1: tree k=2 step 3 of 8 did not finish within 0.3 s")
    assert "the stand-in communicator was aborted" in text and "--timeout" in text
    assert abort.calls == 1 and done.polls > 1
    assert elapsed >= 0.3


def test_a_wait_on_work_that_completes_returns_without_aborting():
    done, abort = DoneAfter(5), Abort()
    box = _bounded(lambda: graphs.wait_for(done, 10.0, what="step", rank=0, abort=abort))
    assert "error" not in box, box
    assert abort.calls == 0 and done.polls == 6


def test_a_failing_abort_is_said_in_the_timeout_line():
    box = _bounded(lambda: graphs.wait_for(NeverDone(), 0.05, what="step 1", abort=Abort(fails=True)))
    text = str(box["error"])
    assert isinstance(box["error"], DistributedError) and "\n" not in text
    assert text.startswith("step 1 did not finish")  # no rank given: none named
    assert "aborting the communicator failed too (RuntimeError: ncclCommAbort failed second line)" in text


def test_no_timeout_waits_on_the_event_itself():
    calls = []

    class Syncs(NeverDone):
        def synchronize(self):
            calls.append(1)

    graphs.wait_for(Syncs(), None, what="step")
    assert calls == [1]


# -- a CapturedStep on stand-in CUDA calls --------------------------------------------------------


class FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeGraph:
    made: ClassVar[list] = []
    log: ClassVar[list] = []

    def __init__(self):
        self.replays = 0
        self.resets = 0
        FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1

    def reset(self):
        self.resets += 1
        FakeGraph.log.append(("reset", FakeGraph.made.index(self)))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Stand-ins for the CUDA calls CapturedStep makes; ``state`` holds the current stream and
    how the capture should fail ("end": ending it raises, as an op that cannot be captured
    does; "begin": beginning it raises; None: it succeeds)."""
    cuda = graphs.torch.cuda
    default = FakeStream("default")
    state = {"current": default, "default": default, "fail": None, "fail_times": None, "syncs": 0, "events": [],
             "captures": 0, "sleeps": []}

    def failing(where):  # state["fail_times"]: how many captures fail (None: every one)
        if state["fail"] != where or state["fail_times"] == 0:
            return False
        if state["fail_times"] is not None:
            state["fail_times"] -= 1
        return True

    def set_stream(s):
        state["current"] = s

    @contextlib.contextmanager
    def stream(s):
        prev = state["current"]
        state["current"] = s
        try:
            yield
        finally:
            state["current"] = prev

    class Capture:  # as torch.cuda.graph: no restore when capture_begin or capture_end raises
        def __init__(self, graph, stream=None, **kw):
            self.stream, self.prev = stream, None

        def __enter__(self):
            self.prev = state["current"]
            state["current"] = self.stream
            state["captures"] += 1
            if failing("begin"):
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            if failing("end"):
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            state["current"] = self.prev
            return False

    def new_event(*a, **k):
        ev = NeverDone()
        state["events"].append(ev)
        return ev

    monkeypatch.setattr(cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(cuda, "set_stream", set_stream)
    monkeypatch.setattr(cuda, "Stream", lambda device=None: FakeStream("side"))
    monkeypatch.setattr(cuda, "stream", stream)
    monkeypatch.setattr(cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda, "graph", Capture)
    monkeypatch.setattr(cuda, "Event", new_event)
    monkeypatch.setattr(cuda, "_sleep", lambda cycles: state["sleeps"].append(cycles))
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: state.__setitem__("syncs", state["syncs"] + 1))
    FakeGraph.made, FakeGraph.log = [], []
    yield state


def test_a_captured_step_whose_replay_never_completes_gives_up_and_frees_the_graphs_first(fake_cuda):
    """step.wait() on a replay that never completes: the step's graph, and every other live graph
    holding NCCL kernels, is freed before the abort (NCCL's abort waits until they are all
    destroyed: aborting first would hang); a local step's graph is left alone. The error names
    the rank and the step; the communicating steps refuse to run again; closing syncs nothing."""
    abort = Abort(log=FakeGraph.log)
    other = graphs.CapturedStep(lambda: "other", CUDA0, communicates=True)  # another layer's step, say
    local = graphs.CapturedStep(lambda: "local", CUDA0)
    step = graphs.CapturedStep(lambda: "out", CUDA0, communicates=True, timeout_s=0.2, abort=abort, rank=3,
                               name="the tree k=2 decode step")
    assert step.captured and step() == "out"
    box = _bounded(step.wait)  # waits on an event of the current stream: a stand-in that never completes
    text = str(box.get("error"))
    assert isinstance(box.get("error"), DistributedError), box
    assert text.startswith("rank 3: the tree k=2 decode step (call 1) did not finish within 0.2 s"), text
    assert "the stand-in communicator was aborted" in text
    assert abort.calls == 1 and fake_cuda["events"] and fake_cuda["events"][0].polls > 0
    assert sorted(FakeGraph.log[:2]) == [("reset", 0), ("reset", 2)] and FakeGraph.log[2:] == ["abort"]
    assert not step.captured and not other.captured and local.captured
    for s in (step, other):
        with pytest.raises(DistributedError, match="cannot run again: the tree k=2 decode step timed out after 0.2 s"):
            s()
    assert local() == "local"
    syncs = fake_cuda["syncs"]
    _bounded(step.close)
    assert fake_cuda["syncs"] == syncs and step.closed
    assert [g.resets for g in FakeGraph.made] == [1, 0, 1]
    local.close()
    other.close()


def test_closing_a_step_whose_last_replay_never_completes_gives_up_too(fake_cuda):
    abort = Abort()
    step = graphs.CapturedStep(lambda: None, CUDA0, communicates=True, timeout_s=0.1, abort=abort, rank=0)
    step()
    box = _bounded(step.close)
    assert isinstance(box.get("error"), DistributedError)
    assert "closing the decode step did not finish" in str(box["error"])
    assert step.closed and abort.calls == 1 and FakeGraph.made[0].resets == 1


def test_a_wait_given_the_steps_event_uses_it(fake_cuda):
    step = graphs.CapturedStep(lambda: None, CUDA0, timeout_s=5.0)
    step()
    done = DoneAfter(2)
    step.wait("tree k=2 step 1 of 8", done=done)
    assert done.polls == 3 and not fake_cuda["events"]  # no event of its own


def test_closing_waits_bounded_then_frees_the_graph_once(fake_cuda, monkeypatch):
    """close() waits for the current stream at most timeout_s (a stand-in that completes), then
    syncs and resets the graph; a second close, and dropping the step, do nothing more."""
    step = graphs.CapturedStep(lambda: None, CUDA0, timeout_s=5.0)
    graph = FakeGraph.made[0]
    monkey_done = DoneAfter(1)
    monkeypatch.setattr(graphs.torch.cuda, "Event", lambda *a, **k: monkey_done)
    step.close()
    assert monkey_done.polls == 2 and graph.resets == 1
    step.close()
    del step
    assert graph.resets == 1


def test_a_dropped_captured_step_frees_its_graph_at_once(fake_cuda):
    """No collector: the last reference going frees the graph (synced, then reset) right there."""
    owner = _Owner()
    graph = FakeGraph.made[0]
    ref = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert ref() is None, "the step outlived its last reference (a reference cycle)"
        assert graph.resets == 1
    finally:
        gc.enable()


class _Owner:
    """A step that owns a CapturedStep the way DecodeStep and TreeDecodeStep do."""

    def __init__(self):
        self.out = torch.zeros(2)
        out = self.out
        self.graph = graphs.CapturedStep(lambda: out.add_(1), CUDA0)


def test_a_dropped_decode_step_is_freed_without_the_garbage_collector():
    """DecodeStep (CPU tensors here): its graph's function does not hold the step, so ``del``
    frees the step and its CapturedStep at once, with the collector off."""
    from tree_attn.kernels.prepared import DecodeStep

    q, k = torch.randn(1, 4, 8), torch.randn(1, 5, 2, 8)
    step = DecodeStep(q, k, k, impl="torch")
    out, _ = step()
    assert torch.isfinite(out).all()
    refs = weakref.ref(step), weakref.ref(step.graph)
    gc.disable()
    try:
        del step
        assert [r() for r in refs] == [None, None], "a reference cycle keeps the step alive until gc.collect()"
    finally:
        gc.enable()


@pytest.mark.parametrize("fail", ["end", "begin"])
@pytest.mark.parametrize("communicates", [False, True])
def test_a_failed_capture_leaves_the_stream_that_was_current(fake_cuda, fail, communicates):
    """Ending (or beginning) the capture raises and torch.cuda.graph does not restore the stream:
    CapturedStep does, whether it then runs eagerly (a local step) or raises (one that talks to
    other ranks)."""
    fake_cuda["fail"] = fail
    if communicates:
        with pytest.raises(DistributedError, match="--no-cuda-graph"):
            graphs.CapturedStep(lambda: None, CUDA0, communicates=True)
    else:
        with pytest.warns(RuntimeWarning, match="capture failed"):
            step = graphs.CapturedStep(lambda: 7, CUDA0)
        assert not step.captured and step() == 7
    assert fake_cuda["current"] is fake_cuda["default"], f"{fake_cuda['current']} left current"


@pytest.mark.parametrize("fail", ["end", "begin"])
@pytest.mark.parametrize("communicates", [False, True])
def test_a_failed_capture_is_followed_by_one_that_takes_the_generator_out_of_capture(fake_cuda, fail, communicates):
    """torch ends a failed capture without its generator epilogue, which leaves the device's
    random state in capture mode (every later random op and replay then fails): a second,
    1-cycle capture that succeeds runs the epilogue, and its graph is freed at once."""
    fake_cuda["fail"], fake_cuda["fail_times"] = fail, 1
    if communicates:
        with pytest.raises(DistributedError) as err:
            graphs.CapturedStep(lambda: None, CUDA0, communicates=True)
        assert "may fail" not in str(err.value)
    else:
        with pytest.warns(RuntimeWarning, match="capture failed") as warned:
            step = graphs.CapturedStep(lambda: 7, CUDA0)
        assert not step.captured and "may fail" not in step.why_eager and "may fail" not in str(warned[0].message)
    assert fake_cuda["captures"] == 2 and fake_cuda["sleeps"] == [1]
    assert ("reset", len(FakeGraph.made) - 1) in FakeGraph.log  # the settling graph, freed
    assert fake_cuda["current"] is fake_cuda["default"]


def test_when_the_settling_capture_fails_too_the_reason_says_random_numbers_may_fail(fake_cuda):
    fake_cuda["fail"] = "end"  # every capture fails
    with pytest.warns(RuntimeWarning, match=r"random numbers on cuda:0 may fail from now on"):
        step = graphs.CapturedStep(lambda: 7, CUDA0)
    assert step.why_eager.startswith("capture failed (RuntimeError: CUDA error: operation failed")
    assert "settling the generator after the failed capture failed too" in step.why_eager
    assert fake_cuda["captures"] == 2 and step() == 7
    assert fake_cuda["current"] is fake_cuda["default"]


def test_a_step_dropped_during_another_capture_is_freed_after_it(fake_cuda, monkeypatch):
    """No device sync inside someone's capture (it would break it): the graph waits for the next
    close outside a capture."""
    step = graphs.CapturedStep(lambda: None, CUDA0)
    graph = FakeGraph.made[0]
    capturing = {"on": True}
    monkeypatch.setattr(graphs, "_capturing", lambda: capturing["on"])
    syncs = fake_cuda["syncs"]
    del step
    assert graph.resets == 0 and fake_cuda["syncs"] == syncs
    capturing["on"] = False
    other = graphs.CapturedStep(lambda: None, CUDA0)  # built outside a capture: frees the deferred
    assert graph.resets == 1 and not graphs._DEFERRED
    other.close()


def test_aborting_a_group_frees_the_graphs_holding_its_kernels_first(fake_cuda, monkeypatch):
    """NCCL's abort waits until every graph holding its kernels is destroyed: abort_group frees
    them before it aborts (at the abort they are gone), and their steps refuse to run after."""
    import torch.distributed as dist

    from tree_attn.reduce import collectives

    step = graphs.CapturedStep(lambda: None, CUDA0, communicates=True)
    local = graphs.CapturedStep(lambda: None, CUDA0)
    resets_at_abort = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda group=None: resets_at_abort.append([g.resets for g in FakeGraph.made]))
    assert collectives.abort_group() == "the process group was aborted"
    assert resets_at_abort == [[1, 0]]
    with pytest.raises(DistributedError, match="cannot run again: its process group was aborted"):
        step()
    local.close()
