"""The GPU fabric: data model, live probes (NVML, AMD SMI, host fallback), recorded dumps,
measurement and comparison. No torch and no vendor library is imported at module import time.
"""

from .amd import probe_amdsmi
from .compare import CheckReport, CheckResult, compare_topologies, junit_xml, write_junit
from .describe import topology_warnings
from .dumps import detect_format, load_dump, load_dumps, parse_dump
from .host import default_cpu_ranks, host_topology
from .io import load_expected, load_topology, save_topology, topology_from_obj, topology_to_yaml
from .model import (
    SCHEMA_VERSION,
    UNKNOWN,
    Device,
    HierarchyLevel,
    Link,
    LinkKind,
    Measurement,
    P2PStatus,
    Topology,
    build_hierarchy,
    format_ranges,
)
from .nvml import BackendUnavailable, probe_nvml
from .probe import BACKENDS, probe_topology

__all__ = [
    "BACKENDS", "SCHEMA_VERSION", "UNKNOWN", "BackendUnavailable", "CheckReport", "CheckResult", "Device",
    "HierarchyLevel", "Link", "LinkKind", "Measurement", "P2PStatus", "Topology", "build_hierarchy",
    "compare_topologies", "default_cpu_ranks", "detect_format", "format_ranges", "host_topology", "junit_xml",
    "load_dump", "load_dumps", "load_expected", "load_topology", "measure_topology", "parse_dump", "probe_amdsmi",
    "probe_nvml", "probe_topology", "save_topology", "topology_from_obj", "topology_to_yaml", "topology_warnings",
    "write_junit",
]


def __getattr__(name: str):
    # measure_topology pulls in torch when called; keep the import lazy so that
    # `import tree_attn.topology` stays light.
    if name == "measure_topology":
        from .measure import measure_topology

        return measure_topology
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
