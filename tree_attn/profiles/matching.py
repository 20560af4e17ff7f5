"""Does a profile apply to this machine? And which software versions is this machine running?

A profile is tuned for one fabric: the same GPU count, the same GPU model and the same link
classes / peer-to-peer status (the topology fingerprint). Anything else is refused, because a plan
tuned for NVSwitch is wrong for PCIe without P2P and a kernel config tuned for an H100 is wrong for
an RTX 4090. Versions only change how fast things are, not which fabric they run on, so a version
difference is a warning.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from ..errors import ProfileError
from ..topology.model import Topology
from .schema import Machine, Profile, Versions, device_kind_of, device_name_of

RETUNE_HINT = (
    "re-tune on this machine with `tree-attn tune --output FILE` "
    "(or `tree-attn tune --force` to replace the saved profile)"
)


def _dist_version(name: str) -> str | None:
    # importlib.metadata reads the installed package's metadata without importing it: importing
    # torch or triton just to read a version costs seconds.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The GPU driver version from NVML or AMD SMI, or None (no GPU, no library, any error).

    Imported lazily: the vendor libraries are optional and absent on CPU machines.
    """
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001, S110 - any failure means "not an NVIDIA machine we can read"
        pass
    try:
        import amdsmi  # type: ignore[import-not-found]

        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            if handles:
                info = amdsmi.amdsmi_get_gpu_driver_info(handles[0])
                v = info.get("driver_version") if isinstance(info, dict) else None
                return str(v) if v else None
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception:  # noqa: BLE001, S110 - any failure means "not an AMD machine we can read"
        pass
    return None


def current_versions(*, driver: str | None | bool = True) -> Versions:
    """Versions of tree-attn, torch, triton and the GPU driver on this machine.

    ``driver``: ``True`` reads it from NVML / AMD SMI, a string uses that, ``None``/``False``
    leaves it unknown (CPU ranks have no driver to speak of).
    """
    from .. import __version__

    if driver is True:
        drv = driver_version()
    elif isinstance(driver, str):
        drv = driver
    else:
        drv = None
    return Versions(tree_attn=__version__, torch=_dist_version("torch"), triton=_dist_version("triton"), driver=drv)


def machine_differences(profile_machine: Machine, topology: Topology) -> list[str]:
    """What makes the profile's machine differ from ``topology`` (empty if they match)."""
    here = Machine.from_topology(topology)
    there = profile_machine
    diffs: list[str] = []
    if there.world_size != here.world_size:
        unit = "GPUs" if there.device_kind != "cpu" else "ranks"
        diffs.append(f"device count: the profile is for {there.world_size} {unit}, this machine has {here.world_size}")
    if there.device_kind != here.device_kind:
        diffs.append(f"device kind: the profile is for {there.device_kind}, this machine is {here.device_kind}")
    if there.device_name != here.device_name:
        diffs.append(f"device model: the profile is for {there.device_name!r}, this machine has {here.device_name!r}")
    if there.fingerprint != here.fingerprint:
        if not diffs:
            # Same count and model: the links differ (class, NVLink count or peer-to-peer status).
            fabric = []
            if there.link_classes and there.link_classes != here.link_classes:
                fabric.append(f"link classes {_counts(there.link_classes)} vs {_counts(here.link_classes)}")
            if there.p2p and there.p2p != here.p2p:
                fabric.append(f"peer-to-peer {_counts(there.p2p)} vs {_counts(here.p2p)}")
            if there.hierarchy and there.hierarchy != here.hierarchy:
                fabric.append(f"hierarchy {' / '.join(there.hierarchy)} vs {' / '.join(here.hierarchy)}")
            detail = "; ".join(fabric) if fabric else "NVLink counts or link details differ"
            diffs.append(f"fabric: fingerprint {there.fingerprint} vs {here.fingerprint} ({detail})")
        else:
            diffs.append(f"fabric fingerprint: {there.fingerprint} vs {here.fingerprint}")
    return diffs


def _counts(d: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def version_warnings(profile_versions: Versions, versions: Versions) -> list[str]:
    """One warning per software version that differs (fields unknown on either side are skipped)."""
    out = []
    for name in Versions.FIELDS:
        a, b = getattr(profile_versions, name), getattr(versions, name)
        if a is not None and b is not None and a != b:
            label = name.replace("_", "-")
            out.append(
                f"the profile was made with {label} {a}, this machine runs {label} {b}: its choices still apply, "
                f"but the best kernel config may have moved; re-tune with `tree-attn tune --force` to refresh it"
            )
    return out


def check_profile_for(profile: Profile, topology: Topology, versions: Versions | None = None) -> list[str]:
    """Check that ``profile`` applies to the machine described by ``topology``.

    Raises ProfileError (saying what differs and how to re-tune) if the device count, device model
    or fabric fingerprint differ; returns warnings (possibly none) when only versions differ.
    ``versions`` defaults to :func:`current_versions` without the driver.
    """
    if not isinstance(profile, Profile):
        raise ProfileError(f"check_profile_for: expected a Profile, got {type(profile).__name__}")
    if not isinstance(topology, Topology):
        raise ProfileError(f"check_profile_for: expected a Topology, got {type(topology).__name__}")
    diffs = machine_differences(profile.machine, topology)
    if diffs:
        raise ProfileError(
            f"profile {profile.name!r} is for another machine: " + "; ".join(diffs) + f"; {RETUNE_HINT}"
        )
    if versions is None:
        versions = current_versions(driver=None)
    return version_warnings(profile.versions, versions)


def profile_matches(profile: Profile, topology: Topology) -> bool:
    """True when ``profile`` is for this machine (no exception, no warnings considered)."""
    try:
        return not machine_differences(profile.machine, topology)
    except ProfileError:
        return False


def describe_topology(topology: Topology) -> dict[str, Any]:
    """The ``machine`` summary of a topology as a plain dict (for messages and ``--json``)."""
    return Machine.from_topology(topology).to_dict()


__all__ = [
    "RETUNE_HINT", "check_profile_for", "current_versions", "describe_topology", "device_kind_of", "device_name_of",
    "driver_version", "machine_differences", "profile_matches", "version_warnings",
]
