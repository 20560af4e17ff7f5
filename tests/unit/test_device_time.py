"""How ``run`` takes and labels a step's device time (issue: eager "device ms" was host time).

Events around a graph replay bracket device work; events around an eager step bracket the host's
pace (the GPU runs each launch as it arrives). So eager steps are timed again queued behind a
spin kernel, and a row says how its device time was taken, or why it has none. The CUDA calls
are stand-ins here; ``test_eager_device_time_on_the_gpu`` (marked ``gpu``) runs the real thing.
"""

from __future__ import annotations

import json

import pytest
import torch

from tree_attn.commands.run import decode as decode_run
from tree_attn.commands.run.decode import (
    DEVICE_TIME_GRAPH,
    DEVICE_TIME_HELD,
    DEVICE_TIME_HOST_BOUND,
    DEVICE_TIME_NO_HOLD,
    RankReport,
    RunSpec,
    device_summary,
    held_device_times,
)
from tree_attn.launch.env import RankEnv
from tree_attn.launch.setup import LaunchSetup
from tree_attn.reduce.plan import ReductionPlan

SPEC = RunSpec(LaunchSetup(world_size=1, plans=(("tree", ReductionPlan("tree", 2)),)), seq_len=16, q_heads=4,
               kv_heads=2, head_dim=8, steps=4, warmup=0)


def _report(device_s, how):
    return RankReport(step_s=[1.0] * 3, bytes_sent_per_step=0, messages_per_step=0, peak_mem_bytes=0,
                      peak_mem_above_start_bytes=0, out=torch.zeros(1), lse=torch.zeros(1),
                      device_step_s=device_s, device_time=how)


def test_a_row_reports_the_slowest_ranks_device_time_and_how_it_was_taken():
    reps = [_report([1e-3, 5e-3, 2e-3], DEVICE_TIME_GRAPH), _report([4e-3, 1e-3, 3e-3], DEVICE_TIME_GRAPH)]
    got = device_summary(reps, 3)
    assert got == {"device_ms_median": pytest.approx(4.0), "device_time": DEVICE_TIME_GRAPH}  # max per step: 4, 5, 3


def test_a_rank_without_device_times_leaves_the_row_without_one_and_says_why():
    reps = [_report([1e-3] * 3, DEVICE_TIME_HELD), _report([], DEVICE_TIME_HOST_BOUND)]
    assert device_summary(reps, 3) == {"device_ms_median": None, "device_time": DEVICE_TIME_HOST_BOUND}
    # CPU ranks: neither
    assert device_summary([_report([], None)], 3) == {"device_ms_median": None, "device_time": None}


def test_the_json_row_carries_the_label():
    from tree_attn.commands.run.decode import StrategyResult

    row = StrategyResult("tree", "tree k=2", 1.0, 1.0, 0, 0.0, 0, 0, 0, 0.0, 0.0, True, device_ms_median=0.5,
                         device_time=DEVICE_TIME_HELD)
    assert json.loads(json.dumps(row.to_dict()))["device_time"] == DEVICE_TIME_HELD


class _Event:
    """A CUDA event stand-in: ``started`` scripts what query() says after each step is issued."""

    def __init__(self, log, started):
        self.log, self.started = log, started

    def record(self, stream=None):
        self.log.append("record")

    def query(self):
        return self.started.pop(0)

    def elapsed_time(self, end):
        return 2.0  # ms


@pytest.fixture
def fake_gpu(monkeypatch):
    state = {"log": [], "started": [], "hold": True, "holds": []}

    def hold_stream(device, us):
        state["holds"].append(us)
        state["log"].append("hold")
        return state["hold"]

    monkeypatch.setattr("tree_attn.timing.hold_stream", hold_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(state["log"], state["started"]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state["log"].append("sync"))
    monkeypatch.setattr(decode_run, "barrier", lambda env: state["log"].append("barrier"))
    return state


def _measure(state, issue_s=1e-4):
    calls, waits = [], []
    q_static = torch.zeros(1, 4, 8)

    def step():
        calls.append(q_static.clone())
        state["log"].append("step")

    def finish(what, done):
        waits.append(what)

    got = held_device_times(RankEnv(1, 1, "nccl", "cuda:0"), SPEC, "tree k=2", step, q_static, issue_s, finish)
    return got, calls, waits


def test_eager_steps_queued_behind_the_hold_give_device_times(fake_gpu):
    """Each extra step: barrier, hold, start event, the step (the timed steps' queries, in
    order), then a bounded wait; the hold outlasts 1.5x the host's longest issue."""
    from tree_attn.timing import HOLD_US

    fake_gpu["started"].extend([False] * SPEC.steps)  # the GPU was still in the hold each time
    (times, how), calls, waits = _measure(fake_gpu, issue_s=2e-4)
    assert how == DEVICE_TIME_HELD and times == [pytest.approx(2e-3)] * SPEC.steps
    assert fake_gpu["holds"] == [pytest.approx(HOLD_US + 300.0)] * SPEC.steps
    assert fake_gpu["log"] == ["barrier", "sync", "hold", "record", "step", "record"] * SPEC.steps
    assert waits == [f"tree k=2 device-time step {s + 1} of {SPEC.steps}" for s in range(SPEC.steps)]
    assert [torch.equal(c, decode_run.make_query(SPEC, s)) for s, c in enumerate(calls)] == [True] * SPEC.steps


def test_a_step_the_gpu_began_before_it_was_all_issued_drops_the_times(fake_gpu):
    fake_gpu["started"].extend([False, True, False, False])
    (times, how), _, _ = _measure(fake_gpu)
    assert times == [] and how == DEVICE_TIME_HOST_BOUND


def test_without_a_spin_kernel_there_is_no_device_time(fake_gpu):
    fake_gpu["hold"] = False
    fake_gpu["started"].extend([True] * SPEC.steps)
    (times, how), _, _ = _measure(fake_gpu)
    assert times == [] and how == DEVICE_TIME_NO_HOLD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_eager_device_time_on_the_gpu(capsys):
    """`run --no-cuda-graph` on one GPU: every row's device time was taken behind a spin kernel
    and is at most the row's wall-clock median (unverified until run on a GPU)."""
    from tree_attn.cli.app import main

    code = main(["run", "--device", "cuda", "-w", "1", "--seq-len", "8192", "--heads", "8", "--kv-heads", "2",
                 "--head-dim", "64", "--steps", "4", "--warmup", "1", "--strategy", "tree,ring", "--no-cuda-graph",
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for row in json.loads(captured.out)["results"]:
        assert row["execution"] == "eager" and row["device_time"] == DEVICE_TIME_HELD, row
        assert 0 < row["device_ms_median"] <= row["step_ms_median"], row


def test_a_timing_graph_that_cannot_be_captured_settles_the_generator_then_falls_back(monkeypatch):
    """``timing._capture`` (graph-timed calls) falls back to eager calls when the capture fails;
    torch then leaves the device's random-number generator in capture mode, which the settling
    capture of ``graphs`` undoes (stand-in CUDA calls; the real failure is the GPU test of
    ``tests/dist/test_replay_timeout_gpu.py``)."""
    from tree_attn import timing

    settled = []

    class FailingCapture:
        def __init__(self, graph, stream=None, capture_error_mode=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "settle_rng_after_failed_capture", lambda device: settled.append(device) or "")
    calls = []
    assert timing._capture([lambda: calls.append(1)], torch.device("cuda", 0)) is None
    assert calls == [1] and settled == [torch.device("cuda", 0)]
