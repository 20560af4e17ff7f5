"""A profile for another machine is refused with the re-tune command; versions only warn."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tree_attn.errors import ProfileError
from tree_attn.profiles import Versions, check_profile_for, load_builtin, profile_matches
from tree_attn.profiles.matching import current_versions
from tree_attn.topology import P2PStatus, host_topology, load_dump

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
SAME = Versions(tree_attn="0.1.0", torch="2.5.1", triton="3.1.0", driver=None)


def test_same_machine_same_versions(profile):
    assert check_profile_for(profile, host_topology(4), SAME) == []
    assert profile_matches(profile, host_topology(4))


def test_other_gpu_count_refused(profile):
    with pytest.raises(ProfileError) as info:
        check_profile_for(profile, host_topology(8), SAME)
    msg = str(info.value)
    assert "device count" in msg and "4" in msg and "8" in msg
    assert "tree-attn tune --output FILE" in msg and "--force" in msg
    assert not profile_matches(profile, host_topology(8))


def _named(topo, name):
    return topo.replace(devices=[dataclasses.replace(d, name=name) for d in topo.devices])


def test_other_gpu_model_refused():
    h100 = load_builtin("h100-8x-nvswitch")
    topo = _named(load_dump(FIX / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"), "NVIDIA H200")
    with pytest.raises(ProfileError) as info:
        check_profile_for(h100, topo, SAME)
    msg = str(info.value)
    assert "device model" in msg and "NVIDIA H100 80GB HBM3" in msg and "NVIDIA H200" in msg
    assert "tree-attn tune" in msg


def test_other_fabric_refused():
    rtx = load_builtin("rtx4090-8x-pcie")
    base = _named(load_dump(FIX / "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt"),
                  "NVIDIA GeForce RTX 4090")
    # Same count and model, but peer-to-peer enabled (a patched driver): another fabric.
    p2p = base.replace(links=[dataclasses.replace(l, p2p=P2PStatus.OK, p2p_reason=None) for l in base.links])
    with pytest.raises(ProfileError) as info:
        check_profile_for(rtx, p2p, SAME)
    msg = str(info.value)
    assert "fabric" in msg and "peer-to-peer" in msg and rtx.machine.fingerprint in msg
    assert "tree-attn tune --output FILE" in msg
    # The built-in's own topology matches it.
    assert check_profile_for(rtx, rtx.topology, Versions()) == []


def test_versions_only_warn(profile):
    newer = Versions(tree_attn="0.2.0", torch="2.6.0", triton="3.1.0", driver="550.1")
    warnings = check_profile_for(profile, host_topology(4), newer)
    assert len(warnings) == 2
    assert "tree-attn 0.1.0" in warnings[0] and "0.2.0" in warnings[0]
    assert "torch 2.5.1" in warnings[1] and "2.6.0" in warnings[1]
    # Unknown on either side: nothing to compare, no warning.
    assert check_profile_for(profile, host_topology(4), Versions()) == []


def test_current_versions_reads_metadata():
    v = current_versions(driver=None)
    assert v.tree_attn and v.driver is None
    assert current_versions(driver="535.1").driver == "535.1"
