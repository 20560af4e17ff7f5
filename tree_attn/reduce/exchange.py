"""The cross-rank merge of partial states, prepared once per (group, plan, shapes): static buffers,
peers and point-to-point operations resolved up front; a call only moves and merges.

Every rank's local kernel writes its state ``(o, lse)`` straight into :attr:`local` of its merge,
a packed float32 message ``[B, Hq, D + 1]`` (``o`` in ``[..., :D]``, ``lse`` in ``[..., D]``): the
message a tree edge carries, so nothing is copied before sending. After the call :attr:`final`
holds the merged state of the whole group, bit-identical on every rank.

Messages and bytes per call are known from the plan (:attr:`traffic`), so a CUDA graph replay,
which runs no Python, is counted exactly like an eager call.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..graphs import persistent_buffers
from .comm import PEER_HINT, global_rank, start_batch, transport_text, wait_all
from .plan import ReductionPlan, ReductionTree
from .state import merge_states


@dataclass(frozen=True)
class Traffic:
    """What one rank sends per merge: point-to-point messages (an all-reduce counted as the
    ``2 (p - 1)`` messages of the ring algorithm, ``2 (p - 1) / p`` of its bytes, the convention of
    NCCL's bus bandwidth), bytes, and collectives joined."""

    messages: int = 0
    bytes_sent: int = 0
    collectives: int = 0


def _message(batch: int, heads: int, head_dim: int, device) -> torch.Tensor:
    """One packed state: float32 ``[B, H, D + 1]``."""
    return torch.empty(batch, heads, head_dim + 1, dtype=torch.float32, device=device)


class TreeMerge:
    """Merge up an explicit tree of point-to-point messages, then send the result back down.

    A node receives its children's states concurrently (one batch), merges them with its own in
    one exact merge, sends the result to its parent and receives the root's result from it (one
    batch), then sends that to its children (one batch). Each non-root rank sends one message up
    and its children's count down.

    Buffers: ``states [1 + C, B, H, D + 1]`` (``[0]`` this rank's, ``[1 + i]`` child i's, received
    in place), ``merged`` (what goes up; ``states[0]`` itself on a leaf) and ``down`` (what comes
    back; none on the root). The send buffer and the receive buffer of one batch are distinct, so
    no operation ever reads a buffer another one is writing.
    """

    def __init__(self, tree: ReductionTree, group, batch: int, heads: int, head_dim: int, device) -> None:
        self.head_dim = head_dim
        rank = dist.get_rank(group)
        self.children = tree.children[rank]
        self.parent = tree.parent[rank]
        n = len(self.children)
        self.states = torch.empty(1 + n, batch, heads, head_dim + 1, dtype=torch.float32, device=device)
        self.local = self.states[0]
        self.merged = self.states[0] if n == 0 else _message(batch, heads, head_dim, device)
        self.down = _message(batch, heads, head_dim, device) if self.parent >= 0 else None
        self.final = self.down if self.down is not None else self.merged
        g = {"group": group}
        self._recv_children = [dist.P2POp(dist.irecv, self.states[1 + i], global_rank(group, c), **g)
                               for i, c in enumerate(self.children)]
        self._up_and_down = [] if self.parent < 0 else [
            dist.P2POp(dist.isend, self.merged, global_rank(group, self.parent), **g),
            dist.P2POp(dist.irecv, self.down, global_rank(group, self.parent), **g),
        ]
        self._send_children = [dist.P2POp(dist.isend, self.final, global_rank(group, c), **g) for c in self.children]
        # Each operation's peer, for an error that names the one that did not complete.
        self._peers = ([f"from rank {c}" for c in self.children],
                       [f"to rank {self.parent}", f"from rank {self.parent}"], [f"to rank {c}" for c in self.children])
        sends = (1 if self.parent >= 0 else 0) + n
        self.traffic = Traffic(messages=sends, bytes_sent=sends * self.local.numel() * 4)
        self._use_triton = torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None

    def __call__(self) -> torch.Tensor:
        """Merge :attr:`local` across the group; returns :attr:`final`."""
        if self._recv_children:
            wait_all(start_batch(self._recv_children, "tree reduce"),
                     f"tree reduce: receive from children {list(self.children)}", self._peers[0])
            self._merge_states()
        if self._up_and_down:
            wait_all(start_batch(self._up_and_down, "tree reduce"), f"tree reduce: exchange with parent {self.parent}",
                     self._peers[1])
        if self._send_children:
            wait_all(start_batch(self._send_children, "tree broadcast"),
                     f"tree broadcast: send to children {list(self.children)}", self._peers[2])
        return self.final

    def _merge_states(self) -> None:
        d = self.head_dim
        if self._use_triton:
            # One kernel: the split merge of the decode kernel, reading the stacked messages in
            # place ([S, B, H, D+1] seen as [B, H, S, D]) and writing the packed result.
            from ..kernels.triton_launch import merge_splits_triton

            o_part, lse_part, out, lse = tree_merge_views(self.states, self.merged, d)
            merge_splits_triton(o_part, lse_part, faulty_is_empty=False, out=out, lse=lse)
            return
        out, lse = merge_states(self.states[..., :d], self.states[..., d])
        self.merged[..., :d].copy_(out)
        self.merged[..., d].copy_(lse)


def tree_merge_views(states: torch.Tensor, merged: torch.Tensor, head_dim: int):
    """The views the tree merge's kernel reads and writes in place: the stacked messages
    ``states [S, B, H, D + 1]`` seen as ``o_part [B, H, S, D]`` and ``lse_part [B, H, S]``, and
    ``merged [B, H, D + 1]`` as ``out [B, H, D]`` and ``lse [B, H]`` (strides of D + 1, lse at
    an offset of D elements)."""
    d = head_dim
    return states[..., :d].permute(1, 2, 0, 3), states[..., d].permute(1, 2, 0), merged[..., :d], merged[..., d]


class AllReduceMerge:
    """The paper's Algorithm 3: an all-reduce (max) of the lse, then one all-reduce (sum) of the
    packed rescaled numerator ``exp(lse - m) o`` and denominator ``exp(lse - m)``.

    A NaN or +inf lse (NaN or inf data on some rank) enters the max as +inf, so every rank sees a
    row max of +inf and gives NaN for that row, as the tree does.
    """

    def __init__(self, group, batch: int, heads: int, head_dim: int, device) -> None:
        self.head_dim = head_dim
        self.group = group
        self.local = _message(batch, heads, head_dim, device)
        self.packed = _message(batch, heads, head_dim, device)
        self.final = _message(batch, heads, head_dim, device)
        self.row_max = torch.empty(batch, heads, dtype=torch.float32, device=device)
        p = dist.get_world_size(group)
        nbytes = (self.packed.numel() + self.row_max.numel()) * 4  # the two all-reduces' payloads
        self.traffic = Traffic(
            messages=4 * (p - 1) if p > 1 else 0,
            bytes_sent=(2 * (p - 1) * nbytes) // p if p > 1 else 0,
            collectives=2 if p > 1 else 0,
        )

    def __call__(self) -> torch.Tensor:
        d = self.head_dim
        o, lse = self.local[..., :d], self.local[..., d]
        faulty = ~(lse < float("inf"))
        self.row_max.copy_(lse).masked_fill_(faulty, float("inf"))
        self._all_reduce(self.row_max, dist.ReduceOp.MAX)
        m = self.row_max
        m_safe = torch.where(torch.isfinite(m), m, 0.0)  # all-empty rows: weights 0, not NaN
        w = torch.exp(torch.where(faulty, float("-inf"), lse) - m_safe)  # 0 for empty states
        self.packed[..., :d].copy_(torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * o, 0.0))
        self.packed[..., d].copy_(w)
        self._all_reduce(self.packed, dist.ReduceOp.SUM)
        num, den = self.packed[..., :d], self.packed[..., d]
        nonempty = den > 0
        safe = torch.where(nonempty, den, 1.0)
        poisoned = m == float("inf")
        out = torch.where(nonempty.unsqueeze(-1), num / safe.unsqueeze(-1), 0.0)
        self.final[..., :d].copy_(torch.where(poisoned.unsqueeze(-1), float("nan"), out))
        lse_out = torch.where(nonempty, m_safe + torch.log(safe), float("-inf"))
        self.final[..., d].copy_(torch.where(poisoned, float("nan"), lse_out))
        return self.final

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        try:
            dist.all_reduce(t, op=op, group=self.group)
        except RuntimeError as exc:
            raise DistributedError(f"all_reduce failed: {transport_text(exc)} ({PEER_HINT})") from exc


@persistent_buffers()  # its buffers are reused call after call, in or out of inference mode
def build_merge(plan: ReductionPlan, group, batch: int, heads: int, head_dim: int,
                device) -> TreeMerge | AllReduceMerge:
    """The merge ``plan`` asks for on this rank (no communication: peers come from the plan)."""
    world = dist.get_world_size(group)
    plan.check(world)
    if plan.strategy == "allreduce":
        return AllReduceMerge(group, batch, heads, head_dim, device)
    return TreeMerge(plan.tree(world), group, batch, heads, head_dim, device)
