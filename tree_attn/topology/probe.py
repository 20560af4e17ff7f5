"""Live probe with backend selection: NVML, then AMD SMI, then the host fallback of CPU ranks."""

from __future__ import annotations

from types import ModuleType

from ..errors import TopologyError
from .amd import probe_amdsmi
from .host import default_cpu_ranks, host_topology
from .model import Topology
from .nvml import BackendUnavailable, probe_nvml

BACKENDS = ("auto", "nvml", "amdsmi", "host")


def probe_topology(
    backend: str = "auto",
    *,
    cpu_ranks: int | None = None,
    nvml_module: ModuleType | None = None,
    amdsmi_module: ModuleType | None = None,
) -> Topology:
    """The topology of this machine.

    ``backend``: ``auto`` tries NVML, then AMD SMI, and falls back to ``cpu_ranks`` CPU ranks
    (gloo) with a note saying why; ``nvml`` / ``amdsmi`` use that backend or fail with a
    :class:`TopologyError`; ``host`` gives the CPU-rank topology directly. ``nvml_module`` /
    ``amdsmi_module`` replace the vendor modules (tests pass fakes).
    """
    if backend not in BACKENDS:
        raise TopologyError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "host":
        return host_topology(cpu_ranks)
    if backend == "nvml":
        return _explicit(probe_nvml, nvml_module, "NVML")
    if backend == "amdsmi":
        return _explicit(probe_amdsmi, amdsmi_module, "AMD SMI")
    reasons = []
    for fn, mod, label in ((probe_nvml, nvml_module, "NVML"), (probe_amdsmi, amdsmi_module, "AMD SMI")):
        try:
            return fn(mod)
        except BackendUnavailable as exc:
            reasons.append(f"{label}: {exc}")
    n = cpu_ranks if cpu_ranks is not None else default_cpu_ranks()
    note = (f"no GPU found ({'; '.join(reasons)}); using a host topology of {n} CPU rank(s) talking through "
            "gloo, so that plans and runs still work on this machine")
    return host_topology(n, note=note)


def _explicit(fn, module, label: str) -> Topology:
    try:
        return fn(module)
    except BackendUnavailable as exc:
        raise TopologyError(f"{label} backend unavailable: {exc}; "
                            "use --backend auto or host on a machine without it") from None
