"""How ranks end, on CPU ranks (gloo): a prepared step is freed when its last reference goes; a
rank that succeeded waits for its peers at a barrier before tearing its group down, and a peer
that never comes gets the group aborted after the timeout, not waited for. (The same on NCCL,
and the replay timeout, need GPUs: tests/dist/test_replay_timeout_gpu.py.)
"""

from __future__ import annotations

from tests.dist.rank_fns import lifetime_and_teardown
from tree_attn.launch.spawn import launch_ranks

DELAY_S = 2.0


def test_steps_are_freed_on_del_and_teardown_waits_for_peers_within_the_timeout(tmp_path):
    flag = tmp_path / "rank0-closed"
    per_rank = launch_ranks(lifetime_and_teardown, 2,
                            args=(str(tmp_path / "second-group"), str(tmp_path / "rank0-entered"), str(flag), DELAY_S),
                            timeout_s=60.0)
    for rank, found in enumerate(per_rank):
        assert found["step_timeout_s"] == 60.0, found  # the group's own timeout bounds the step's waits
        assert found["finite"], found
        assert found["freed"] == [True, True], f"rank {rank}: the step outlived its last reference"
        assert found["first_closed"], found
    # Rank 1 entered its close DELAY_S after rank 0 had entered its own: rank 0's teardown waited
    # for it. (Without the barrier rank 0 would have returned DELAY_S before rank 1 came.) Both
    # times are time.monotonic(), one clock for the host's processes.
    zero, one = per_rank
    assert one["saw_entered"], one
    assert zero["first_returned_at"] >= one["first_arrived_at"], (
        f"rank 0's close returned {one['first_arrived_at'] - zero['first_returned_at']:.3f} s before rank 1 "
        f"reached its own: {per_rank}")
    # Second group: rank 1 never came; rank 0 gave up after its 1 s, aborted, said so, returned.
    assert 1.0 <= zero["gave_up_after_s"] < 30.0, zero
    assert zero["second_closed"], zero
    assert any("rank 0: a peer did not reach the end of the job within 1 s" in w and "aborted" in w
               for w in zero["warnings"]), zero["warnings"]
    assert one["saw_flag"], one
