"""Which rank's error the launcher reports (``launch.spawn._cause``): a rank whose peer went away
first reports only that ("Connection closed by peer"); the peer's own error is the cause and is
reported instead when it arrives within the grace period. No processes here: a queue stands in
for the ranks' result queue (the spawned case is in tests/dist/test_collectives.py)."""

from __future__ import annotations

import queue
import time

from tree_attn.launch import spawn

GONE = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:1949. This is typically caused by a remote worker crashing.")


def _error(rank: int, text: str) -> tuple:
    return ("error", rank, text.split(":", 1)[0], text, "Traceback (most recent call last): ...")


def test_a_ranks_own_error_is_reported_at_once():
    own = _error(1, "ValueError: a bad input")
    t0 = time.monotonic()
    assert spawn._cause(own, queue.Queue(), grace_s=60.0) is own
    assert time.monotonic() - t0 < 30.0  # did not wait out the grace


def test_a_lost_peer_gives_way_to_the_peers_own_error():
    results = queue.Queue()
    results.put(("ok", 2, b""))  # a rank that finished: skipped, the run fails anyway
    results.put(_error(2, "RuntimeError: NCCL error: remote process exited or there was a network error"))
    results.put(_error(1, "ValueError: a bad input"))
    assert spawn._cause(_error(0, GONE), results, grace_s=5.0)[1] == 1


def test_a_lost_peer_alone_is_reported_after_the_grace():
    first = _error(0, GONE)
    t0 = time.monotonic()
    assert spawn._cause(first, queue.Queue(), grace_s=0.3) is first
    assert time.monotonic() - t0 >= 0.3  # waited the grace for a peer's own error


def test_what_counts_as_a_lost_peer():
    assert spawn._peer_gone(_error(0, GONE))
    assert spawn._peer_gone(_error(0, "RuntimeError: Connection reset by peer"))
    assert spawn._peer_gone(_error(0, "BrokenPipeError: [Errno 32] Broken pipe"))
    assert not spawn._peer_gone(_error(0, "ValueError: shapes differ"))
    assert not spawn._peer_gone(("ok", 0, b""))
