"""Reduction plans: who merges with whom, in which order. Pure data and pure functions.

A plan never touches torch.distributed; ``reduce.collectives`` executes it. Strategies:

- ``allreduce``: the paper's Algorithm 3: an all-reduce (max) of the lse, then one all-reduce
  (sum) of the packed rescaled numerator and denominator. The collective library picks its own
  algorithm (NCCL's is itself topology-aware), so fan-out and rank order do not apply.
- ``tree``: an explicit reduction tree of point-to-point messages. Each node receives its
  children's states, merges them with its own, sends the result to its parent; the root's result
  then travels back down the same edges. The tree is either a k-ary heap along ``rank_order``
  (fan-out ``fanout``) or given explicitly by ``parents`` (topology-aware plans).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..validate import check_int

STRATEGIES = ("allreduce", "tree")


@dataclass(frozen=True)
class ReductionTree:
    """A rooted tree over ranks ``0..world_size-1``.

    ``parent[r]`` is the parent of rank r (-1 for the root); ``children[r]`` its children in the
    order they are merged; ``depth[r]`` its distance from the root.
    """

    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]

    @property
    def root(self) -> int:
        return self.parent.index(-1)

    @property
    def height(self) -> int:
        """Edges on the longest root-to-leaf path (0 for one rank)."""
        return max(self.depth)

    @classmethod
    def from_parents(cls, parents, order=None) -> ReductionTree:
        """Build from a parent array, checking that it is a single tree spanning every rank.

        ``order`` (a permutation of the ranks) sets the order of each node's children; default by rank.
        """
        parents = tuple(int(p) for p in parents)
        n = len(parents)
        if n == 0:
            raise ConfigError("a reduction tree needs at least one rank")
        roots = [r for r, p in enumerate(parents) if p == -1]
        if len(roots) != 1:
            raise ConfigError(f"a reduction tree needs exactly one root (parent -1); got roots {roots}")
        for r, p in enumerate(parents):
            if p != -1 and not (0 <= p < n) or p == r:
                raise ConfigError(f"parents[{r}]={p} is not a valid parent among {n} ranks")
        children: list[list[int]] = [[] for _ in range(n)]
        for r in order if order is not None else range(n):
            if parents[r] >= 0:
                children[parents[r]].append(r)
        depth = [-1] * n
        depth[roots[0]] = 0
        stack = [roots[0]]
        while stack:
            node = stack.pop()
            for c in children[node]:
                depth[c] = depth[node] + 1
                stack.append(c)
        unreached = [r for r in range(n) if depth[r] < 0]
        if unreached:
            raise ConfigError(f"parents do not form one tree: ranks {unreached} are in a cycle, cut off from the root")
        return cls(parent=parents, children=tuple(tuple(c) for c in children), depth=tuple(depth))


def kary_tree(rank_order: tuple[int, ...] | list[int], fanout: int) -> ReductionTree:
    """A k-ary heap along ``rank_order``: the rank at position i has parent at position (i-1)//k.

    The first rank of ``rank_order`` is the root; consecutive ranks share a parent, so putting
    ranks joined by fast links next to each other keeps the leaf edges on fast links.
    """
    if fanout < 2:
        raise ConfigError(f"fan-out must be at least 2; got {fanout}")
    order = list(rank_order)
    parents = [-1] * len(order)
    for pos in range(1, len(order)):
        parents[order[pos]] = order[(pos - 1) // fanout]
    return ReductionTree.from_parents(parents, order)


@dataclass(frozen=True)
class ReductionPlan:
    """How the partial states of all ranks are combined.

    Attributes:
        strategy: "allreduce" or "tree".
        fanout: children per node for a k-ary tree (2 .. world size; larger is the flat tree).
        rank_order: tree order of the ranks (root first); None means 0..p-1.
        parents: an explicit tree (``parents[r]`` = parent rank, -1 for the root), e.g. from the
            topology hierarchy; overrides ``fanout``/``rank_order`` when given.
        label: a short human name ("tree k=4", "hier nvlink>sys k=2"...).
    """

    strategy: str = "tree"
    fanout: int = 2
    rank_order: tuple[int, ...] | None = None
    parents: tuple[int, ...] | None = None
    label: str = field(default="")

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        check_int(self.fanout, "fanout", minimum=2, must=True)
        if self.rank_order is not None:
            object.__setattr__(self, "rank_order", tuple(int(r) for r in self.rank_order))
        if self.parents is not None:
            object.__setattr__(self, "parents", tuple(int(r) for r in self.parents))
        if not self.label:
            object.__setattr__(self, "label", self._default_label())

    def _default_label(self) -> str:
        if self.strategy == "allreduce":
            return "allreduce"
        if self.parents is not None:
            return "tree (explicit)"
        return f"tree k={self.fanout}"

    def check(self, world_size: int) -> None:
        """Raise ConfigError if this plan cannot run on ``world_size`` ranks."""
        if self.rank_order is not None and sorted(self.rank_order) != list(range(world_size)):
            raise ConfigError(
                f"rank_order must be a permutation of 0..{world_size - 1}; got {list(self.rank_order)}"
            )
        if self.parents is not None and len(self.parents) != world_size:
            raise ConfigError(f"parents has {len(self.parents)} entries for {world_size} ranks")
        if self.strategy == "tree":
            self.tree(world_size)

    def tree(self, world_size: int) -> ReductionTree:
        """The reduction tree over ``world_size`` ranks (strategy "tree")."""
        if self.parents is not None:
            if len(self.parents) != world_size:
                raise ConfigError(f"parents has {len(self.parents)} entries for {world_size} ranks")
            return ReductionTree.from_parents(self.parents)
        order = self.rank_order if self.rank_order is not None else tuple(range(world_size))
        if sorted(order) != list(range(world_size)):
            raise ConfigError(f"rank_order must be a permutation of 0..{world_size - 1}; got {list(order)}")
        return kary_tree(order, self.fanout)

    def to_dict(self) -> dict:
        d = {"strategy": self.strategy, "fanout": self.fanout, "label": self.label}
        if self.rank_order is not None:
            d["rank_order"] = list(self.rank_order)
        if self.parents is not None:
            d["parents"] = list(self.parents)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ReductionPlan:
        known = {"strategy", "fanout", "rank_order", "parents", "label"}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown plan keys: {', '.join(sorted(unknown))}")
        return cls(**d)


@functools.cache
def default_plan(world_size: int) -> ReductionPlan:
    """The plan used when none is given and no profile applies.

    The explicit binary tree: log2(p) point-to-point hops up and down with one small message per
    edge. On CPU ranks over gloo it beat the all-reduce form (see benchmarks/RESULTS.md); on GPUs
    a tuned profile replaces it.
    """
    return ReductionPlan(strategy="tree", fanout=2)
