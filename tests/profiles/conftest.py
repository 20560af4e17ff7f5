"""Shared fixtures of the profile tests: a measured-looking profile for 4 CPU ranks, a temp
profile folder (``TREE_ATTN_PROFILE_DIR``) so that nothing touches the user's cache."""

from __future__ import annotations

import pytest

from tree_attn.kernels.config import DecodeConfig
from tree_attn.profiles import KernelBucket, KernelSection, Machine, PlanCandidate, Profile, Reduction, Versions
from tree_attn.reduce.plan import ReductionPlan
from tree_attn.topology import host_topology


def make_profile(n: int = 4, *, name: str = "test-cpu", origin: str = "measured",
                 with_topology: bool = True) -> Profile:
    """A profile as `tune` would write it on ``n`` CPU ranks: measured plan candidates, two
    kernel buckets (one measured, one model), full topology."""
    topo = host_topology(n)
    k2 = ReductionPlan("tree", 2)
    k4 = ReductionPlan("tree", 4)
    ar = ReductionPlan("allreduce")
    measured = origin == "measured"
    by = "measured" if measured else "model"
    cands = [
        PlanCandidate(label=p.label, plan=p, chosen_by=by,
                      median_us=(m if measured else None), p95_us=(m * 1.3 if measured else None),
                      predicted_us=m * 0.9, selected=(p == k2))
        for p, m in ((ar, 310.5), (k2, 201.25), (k4, 250.0))
    ]
    buckets = [
        KernelBucket("bfloat16", 128, 4, 8192, DecodeConfig(64, 4, 2, 8), "measured" if measured else "model",
                     time_us=(21.5 if measured else None), gbps=(812.0 if measured else None), predicted_us=19.0,
                     candidates_tried=12),
        KernelBucket("bfloat16", 128, 4, 65536, DecodeConfig(64, 4, 3, 32), "model", predicted_us=140.0,
                     candidates_tried=200),
        KernelBucket("float16", 64, 1, 4096, DecodeConfig(128, 4, 2, None), "default"),
    ]
    return Profile(
        name=name,
        created="2025-03-04T05:06:07Z",
        origin=origin,
        description="fixture",
        versions=Versions(tree_attn="0.1.0", torch="2.5.1", triton="3.1.0", driver=None),
        machine=Machine.from_topology(topo),
        kernel=KernelSection(device_spec="cpu", buckets=buckets),
        reduction=Reduction(plan=k2, chosen_by=by, message_bytes=16512, candidates=cands),
        notes=["made by the test fixture"],
        topology=topo if with_topology else None,
    )


@pytest.fixture
def profile() -> Profile:
    return make_profile()


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    d = tmp_path / "saved-profiles"
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(d))
    return d
