"""Measurement through gloo on 2 CPU ranks (small and few), and on GPUs when present."""

from __future__ import annotations

import pytest

from tree_attn.topology import host_topology
from tree_attn.topology.measure import DECODE_MESSAGE_BYTES, measure_topology


def test_decode_message_size():
    assert DECODE_MESSAGE_BYTES == 32 * 129 * 4 == 16512


def test_measure_cpu_ranks_gloo():
    t = measure_topology(host_topology(2), iterations=2, copy_bytes=64 * 1024)
    l = t.link(0, 1)
    assert l.bandwidth_source == "measured" and l.bandwidth_gbps > 0 and l.latency_us > 0
    m = t.measurement
    assert m.method.startswith("gloo") and m.iterations == 2 and m.copy_bytes == 64 * 1024
    assert m.allreduce_bytes == DECODE_MESSAGE_BYTES and m.allreduce_latency_us > 0
    assert t.fingerprint == host_topology(2).fingerprint  # measured numbers are not identity
    assert t.to_dict()["measurement"]["method"] == m.method


@pytest.mark.gpu
def test_measure_gpus():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from tree_attn.topology import probe_topology

    t = probe_topology()
    t = measure_topology(t, iterations=3)
    assert all(l.bandwidth_source == "measured" and l.bandwidth_gbps > 0 for l in t.links)
