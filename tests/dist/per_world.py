"""Distributed tests launch their ranks once per world size (spawning is the slow part on two
cores) and check every case of that size on the results: one test per (world size, case)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def each_case(worlds: Sequence[int], cases_for: Callable[[int], list]):
    """``@pytest.mark.parametrize("world,index", ...)`` over every case of every world size, each
    named ``w<world>-<case name>``."""
    return pytest.mark.parametrize(
        "world,index",
        [(w, i) for w in worlds for i in range(len(cases_for(w)))],
        ids=[f"w{w}-{c.name}" for w in worlds for c in cases_for(w)],
    )
