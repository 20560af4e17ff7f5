"""The bounded wait on a CUDA-graph replay, on real GPUs (marked ``gpu``; the mechanism on CPU
stand-ins is in tests/unit/test_captured_step.py).

NCCL work recorded in a graph has no watchdog: a replayed receive whose peer stalls would block
``torch.cuda.synchronize()`` forever. ``step.wait()`` polls an event against the timeout instead,
aborts the communicator and raises one line naming the rank and the step.

- One GPU: a captured spin kernel that outlasts the timeout stands for a replay that does not
  finish (NCCL will not put two ranks of one communicator on one GPU).
- Two GPUs: the real case, a replayed tree step whose peer never replays its own.
- A capture that fails on a real GPU leaves the stream that was current.

Written without a GPU at hand: unverified until run on one (``benchmarks/gpu_checks.sh`` runs
this file as its own step, ``replay-timeout``).
"""

from __future__ import annotations

import time

import pytest
import torch

from tree_attn import graphs
from tree_attn.errors import DistributedError

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.gpu

SPIN_S = 8.0  # the captured kernel spins at least this long
TIMEOUT_S = 1.0


def _cycles(seconds: float) -> int:
    """Clock cycles lasting at least ``seconds`` (the reported clock is the maximum; 2 GHz where
    torch does not report it, longer than any of these GPUs' maximum)."""
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 2_000_000
    return int(seconds * rate_khz * 1e3)


@pytest.mark.skipif(N_GPUS < 1, reason="needs a GPU")
def test_a_replay_that_outlasts_the_timeout_is_given_up_on_one_gpu():
    dev = torch.device("cuda", 0)
    spins = [1000, _cycles(SPIN_S)]  # the warm-up call spins briefly, the captured one long
    aborted = []
    step = graphs.CapturedStep(lambda: torch.cuda._sleep(spins.pop(0)), dev, warmup=1, communicates=True,
                               timeout_s=TIMEOUT_S, abort=lambda: aborted.append(1) or "stand-in abort done",
                               rank=0, name="the spin step")
    assert step.captured, step.why_eager
    try:
        step()
        t0 = time.monotonic()
        with pytest.raises(DistributedError) as err:
            step.wait()
        elapsed = time.monotonic() - t0
        text = str(err.value)
        assert text.startswith(f"rank 0: the spin step (call 1) did not finish within {TIMEOUT_S:g} s"), text
        assert "stand-in abort done" in text and "\n" not in text and aborted == [1]
        assert TIMEOUT_S <= elapsed < SPIN_S / 2, elapsed  # gave up at the deadline, not after the kernel
        # The graph was freed while its kernel still ran (CUDA frees it once it ends): nothing
        # left to sync on when closing.
        assert not step.captured
        step.close()
        assert step.closed
    finally:
        torch.cuda.synchronize(dev)  # let the spin end before the next test


@pytest.mark.skipif(N_GPUS < 1, reason="needs a GPU")
def test_a_capture_that_fails_on_the_gpu_leaves_the_current_stream():
    """`.item()` syncs, which a capture cannot hold: capture fails, the step runs eagerly, and
    the stream that was current is current again (torch.cuda.graph does not restore it when
    ending the capture raises)."""
    dev = torch.device("cuda", 0)
    before = torch.cuda.current_stream(dev)
    x = torch.ones(4, device=dev)
    counter = torch.zeros(1, device=dev)
    earlier = graphs.CapturedStep(lambda: counter.add_(1), dev, warmup=1)  # captured before the failure
    assert earlier.captured, earlier.why_eager
    with pytest.warns(RuntimeWarning, match="capture failed") as warned:
        step = graphs.CapturedStep(lambda: x.sum().item(), dev)
    assert not step.captured and "may fail" not in str(warned[0].message)
    assert torch.cuda.current_stream(dev) == before
    assert step() == 4.0
    torch.cuda.synchronize(dev)  # the device is usable after the failed capture
    # torch ends the failed capture without taking the device's generator out of capture mode; the
    # step's settling capture does (else both lines below raise "Offset increment outside graph
    # capture encountered unexpectedly", as every later test of the same process did on an H100).
    assert torch.randn(1000, device=dev).std().item() > 0.5
    earlier()
    earlier.wait()
    assert counter.item() == 2.0  # the warm-up run, then the replay
    earlier.close()


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_a_replayed_receive_whose_peer_never_sends_times_out_on_two_gpus(tmp_path):
    from tests.dist.rank_fns import replay_without_peer
    from tree_attn.launch.spawn import launch_ranks

    per_rank = launch_ranks(replay_without_peer, 2, args=(str(tmp_path / "flag"), 3.0), backend="nccl",
                            device_kind="cuda", timeout_s=60.0)
    (captured0, error, still_initialized), (captured1, _, saw_flag) = per_rank
    assert captured0 and captured1, "the steps ran eagerly: nothing replayed"
    assert error is not None, "the wait returned although the peer never sent"
    assert error.startswith("rank 0: the replay without its peer did not finish within 3 s"), error
    assert "process group was aborted" in error and "\n" not in error
    assert not still_initialized and saw_flag
