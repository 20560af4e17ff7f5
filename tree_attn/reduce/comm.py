"""Thin wrappers over torch.distributed that count what each rank sends.

Counting rules (per rank, per call):
- point-to-point send: one message of ``numel * element_size`` bytes;
- all_reduce of n bytes over p ranks: ``2 (p-1)/p * n`` bytes in ``2 (p-1)`` messages, what the
  ring algorithm moves (the convention of NCCL's "bus bandwidth"); other algorithms move about as
  much;
- all_gather of n bytes per rank: ``(p-1) * n`` bytes in ``p-1`` messages (ring).
These are the bytes on the wire for the algorithm named, not measured NIC counters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedError


@dataclass
class CommStats:
    """Messages and bytes this rank has sent, and the collectives it joined."""

    messages: int = 0
    bytes_sent: int = 0
    collectives: int = 0

    def reset(self) -> None:
        self.messages = self.bytes_sent = self.collectives = 0

    def add(self, traffic) -> None:
        """Count one call of a prepared merge (its ``Traffic``, known from the plan)."""
        self.messages += traffic.messages
        self.bytes_sent += traffic.bytes_sent
        self.collectives += traffic.collectives


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (identity for the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
            "(or launch through `tree-attn run` / torchrun)"
        )


def all_gather(t: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    """Gather ``t`` from every rank: returns ``[p, *t.shape]``."""
    p = dist.get_world_size(group)
    out = torch.empty((p, *t.shape), dtype=t.dtype, device=t.device)
    if stats is not None and p > 1:
        stats.collectives += 1
        stats.messages += p - 1
        stats.bytes_sent += (p - 1) * _nbytes(t)
    parts = list(out.unbind(0))
    try:
        dist.all_gather(parts, t.contiguous(), group=group)
    except RuntimeError as exc:
        raise DistributedError(f"all_gather failed: {exc}") from exc
    return out


def batch_p2p(sends, recvs, group, stats: CommStats | None) -> list:
    """Start a batch of point-to-point operations as one group; returns the requests.

    ``sends`` and ``recvs`` are ``(tensor, group_rank)`` pairs. Each send counts one message.
    """
    ops = []
    for t, dst in sends:
        if stats is not None:
            stats.messages += 1
            stats.bytes_sent += _nbytes(t)
        ops.append(dist.P2POp(dist.isend, t, global_rank(group, dst), group))
    for t, src in recvs:
        ops.append(dist.P2POp(dist.irecv, t, global_rank(group, src), group))
    return start_batch(ops, "point-to-point batch")


def start_batch(ops: list, what: str) -> list:
    """Start ``dist.P2POp`` operations as one batch; returns the requests.

    Batched, not one by one: NCCL creates a two-rank communicator lazily on the first unbatched
    send/recv between a pair, and that creation blocks until both ranks reach it; in a ring (rank r
    sends to r+1 while r+1 sends to r+2, ...) the creations wait on each other in a cycle and never
    finish for 3 or more ranks. ``batch_isend_irecv`` issues the whole batch as one NCCL group on
    the group's own communicator, where its operations progress together. (Gloo sends and
    receives each op on its own, in order.)
    """
    if not ops:
        return []
    try:
        return dist.batch_isend_irecv(ops)
    except RuntimeError as exc:
        raise DistributedError(f"{what} failed: {exc}") from exc


# The C++ source location gloo puts before its messages ("[/__w/pytorch/pytorch/third_party/gloo/
# gloo/transport/tcp/unbound_buffer.cc:78] Timed out ..."): noise in a one-line error.
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")

PEER_HINT = "a peer rank may have died, hung or become unreachable"


def transport_text(exc: BaseException) -> str:
    """A backend's error as one line, without gloo's C++ source locations."""
    return " ".join(_SOURCE_LOCATION.sub("", str(exc)).split())


def wait_all(requests, what: str, peers: Sequence[str] | None = None) -> None:
    """Wait for ``requests`` in order. ``peers`` describes each request's message ("from rank 2",
    "to rank 0"); when there is one request per operation (gloo; NCCL returns one for the whole
    batch) a failure names the message that did not complete: the peer it waited on."""
    for i, r in enumerate(requests):
        try:
            r.wait()
        except RuntimeError as exc:
            on = f" on the message {peers[i]}" if peers is not None and len(peers) == len(requests) else ""
            raise DistributedError(f"{what} failed{on}: {transport_text(exc)} ({PEER_HINT})") from exc
