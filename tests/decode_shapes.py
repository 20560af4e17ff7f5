"""The random decode shapes the kernel tests draw (hypothesis): batch, KV heads, GQA group, head dim,
cache length, tile and split count, and a valid length per row (0 to the cache length, so empty
rows and lengths off the tile boundary both occur)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class DecodeCase:
    """One drawn shape: ``q [b, hkv * group, d]`` over a ``[b, n, hkv, d]`` cache, rows' valid lengths ``lens``."""

    b: int
    hkv: int
    group: int
    d: int
    n: int
    block_n: int
    splits: int
    lens: list[int]

    def __str__(self) -> str:
        return f"b{self.b} g{self.group} d{self.d} n{self.n}"


@st.composite
def decode_cases(draw, *, groups: list[int], head_dims: list[int], max_splits: int) -> DecodeCase:
    """A :class:`DecodeCase` with a group from ``groups``, a head dim from ``head_dims``, 1 to
    ``max_splits`` splits, 1-3 rows, 1-2 KV heads, up to 70 tokens and 16- or 32-token tiles."""
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from(groups))
    d = draw(st.sampled_from(head_dims))
    n = draw(st.integers(0, 70))
    block_n = draw(st.sampled_from([16, 32]))
    splits = draw(st.integers(1, max_splits))
    lens = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    return DecodeCase(b, hkv, group, d, n, block_n, splits, lens)
