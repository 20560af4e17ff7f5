"""Which prompt positions each rank prefills: the zig-zag assignment of context-parallel prefill.

The ``n`` prefill tokens are cut into ``2p`` contiguous chunks of near-equal size; rank ``r`` holds
chunk ``r`` and chunk ``2p - 1 - r`` (ring-flash-attention's "zigzag", the layout Striped
Attention's paper balances with stripes). Why: under causal attention a query at position ``i``
attends to ``i + 1`` keys, so with contiguous shards the last rank's work is ``2p - 1`` times the
first's and the whole prefill waits for it. Pairing an early chunk with the mirrored late chunk
gives every rank about ``n^2 / (2p)`` query-key pairs (chunk ``c`` of ``m`` tokens costs about
``m^2 (c + 1/2)``; chunks ``r`` and ``2p - 1 - r`` together ``2p m^2``, the same for every r) and
about ``n / p`` tokens of KV. The decode merge is order-free, so the layout costs decode nothing.

Sizes: rank ``r`` holds ``n // p`` tokens, one more for the first ``n % p`` ranks, so the last
rank, which receives the new tokens' KV during decode, holds the fewest prompt tokens. Its
earlier chunk takes the smaller half (``n_r // 2``), its later chunk the rest; chunks differ by at
most one token. ``n < 2p`` leaves chunks empty, ``n < p`` whole ranks empty: such a rank holds
no run but still takes part in every exchange.

A rank's tokens are stored in position order (its runs sorted), so its own block is causal by
index: a query sees the block's keys up to itself.

No torch here: the assignment is pure arithmetic, shared by the ranks (each computes it; nothing
about it is sent) and by the capacity arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from ..errors import ConfigError

__all__ = ["Run", "SequenceShards", "contiguous", "zigzag"]


@dataclass(frozen=True)
class Run:
    """Contiguous prompt positions ``start .. stop - 1``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ConfigError(f"a run of positions must satisfy 0 <= start < stop; got {self.start}..{self.stop}")

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SequenceShards:
    """Which positions of an ``tokens``-token sequence each rank holds.

    ``runs[r]``: rank r's runs of positions, sorted, non-empty, disjoint from every other rank's;
    together they cover ``0 .. tokens - 1`` exactly once. ``scheme`` names the layout.
    """

    tokens: int
    runs: tuple[tuple[Run, ...], ...]
    scheme: str = "zigzag"

    def __post_init__(self) -> None:
        covered = sorted((run.start, run.stop) for mine in self.runs for run in mine)
        at = 0
        for start, stop in covered:
            if start != at:
                raise ConfigError(f"runs must cover 0..{self.tokens - 1} exactly once; position {at} is "
                                  f"{'missing' if start > at else 'held twice'}")
            at = stop
        if at != self.tokens:
            raise ConfigError(f"runs cover 0..{at - 1}, not the {self.tokens} tokens")
        for r, mine in enumerate(self.runs):
            if any(a.stop > b.start for a, b in pairwise(mine)):
                raise ConfigError(f"rank {r}'s runs must be sorted by position; got {mine}")

    @property
    def world_size(self) -> int:
        return len(self.runs)

    def size(self, rank: int) -> int:
        """Tokens rank ``rank`` holds."""
        return sum(run.size for run in self.runs[rank])

    def sizes(self) -> list[int]:
        return [self.size(r) for r in range(self.world_size)]

    def positions(self, rank: int) -> list[int]:
        """Rank ``rank``'s positions in the order it stores them (ascending)."""
        return [i for run in self.runs[rank] for i in range(run.start, run.stop)]

    def causal_pairs(self, rank: int) -> int:
        """Query-key pairs rank ``rank``'s queries attend to under causal attention (a query at
        position i sees i + 1 keys): its share of the prefill's attention work."""
        return sum((run.start + 1 + run.stop) * run.size // 2 for run in self.runs[rank])

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "tokens": self.tokens,
                "runs": [[[run.start, run.stop] for run in mine] for mine in self.runs]}


def _check(tokens: int, world_size: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigError(f"tokens must be an integer >= 0; got {tokens!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be an integer >= 1; got {world_size!r}")


def _rank_sizes(tokens: int, world_size: int) -> list[int]:
    base, extra = divmod(tokens, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def zigzag(tokens: int, world_size: int) -> SequenceShards:
    """The zig-zag assignment of ``tokens`` positions over ``world_size`` ranks (see the module)."""
    _check(tokens, world_size)
    p = world_size
    sizes = _rank_sizes(tokens, p)
    chunks = [0] * (2 * p)  # chunk c's size
    for r, n_r in enumerate(sizes):
        chunks[r] = n_r // 2
        chunks[2 * p - 1 - r] = n_r - n_r // 2
    starts = [sum(chunks[:c]) for c in range(2 * p)]
    runs = []
    for r in range(p):
        mine = [Run(starts[c], starts[c] + chunks[c]) for c in (r, 2 * p - 1 - r) if chunks[c]]
        runs.append(tuple(mine))
    return SequenceShards(tokens, tuple(runs), "zigzag")


def contiguous(tokens: int, world_size: int) -> SequenceShards:
    """Contiguous shards (rank r the r-th slice; the first ``tokens % world_size`` one longer):
    the layout zig-zag replaces, kept for comparison (its last rank does most of the causal work)."""
    _check(tokens, world_size)
    sizes = _rank_sizes(tokens, world_size)
    starts = [sum(sizes[:r]) for r in range(world_size)]
    runs = tuple((Run(s, s + n),) if n else () for s, n in zip(starts, sizes))
    return SequenceShards(tokens, runs, "contiguous")
