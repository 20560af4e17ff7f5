"""Cost-model parameters from what the tool measured: a probed topology (``probe --measure``), a
profile (``tune``: plan timings and kernel bandwidths), or a parameters file written by the
calibration (``benchmarks/calibrate_costmodel.py``). Pure Python, no torch.

How measured numbers map onto the model:

- A measured link (``probe --measure``): ``latency_us`` (half a ping-pong of 8 bytes) is the
  class's point-to-point alpha, ``bandwidth_gbps`` (large copies) its beta.
- A measured all-reduce of the decode message over n ranks (``measurement.allreduce_latency_us``)
  is ``collective_us + 2 (n - 1) step + bytes term``: the per-step alpha is what remains, per step.
- A profile's measured plan candidates time the merge alone at n ranks; its kernel buckets'
  ``gbps`` give the kernel's achieved bandwidth (``kernel_fraction`` = gbps / the device's).
Everything a source does not measure comes from the preset of the same device, else the
link-class table (:data:`tree_attn.cost.links.LINK_COSTS`), and the parameters say which in ``source``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from ..errors import ConfigError
from ..validate import check_int, is_int
from .links import LINK_COSTS, LinkParams, link_class
from .params import ClusterSpec, DeviceParams
from .presets import CPU_RANK, GRAPH_STEP_US, H100_SXM, MI300X, RTX_4090, preset, preset_for_device

# The presets' devices by their catalogue name.
PRESET_DEVICES = {d.name: d for d in (H100_SXM, MI300X, RTX_4090)}


def device_for(name: str) -> DeviceParams | None:
    """The preset device matching a device name, else a generic one from the device catalogue,
    else None (a recorded dump names no device)."""
    from .devices import lookup_known_device

    spec = lookup_known_device(name)
    if spec is None:
        return None
    if spec.name in PRESET_DEVICES:
        return dataclasses.replace(PRESET_DEVICES[spec.name], name=name)
    return DeviceParams.from_spec(spec, name=name, kernel_fraction=0.85, merge_us=8.0, collective_us=5.0,
                                  source=f"memory bandwidth from the device catalogue ({spec.bandwidth_source}); "
                                         "the rest as the H100 preset")


def topology_device(topo, fallback: DeviceParams | None = None) -> DeviceParams:
    """The device a topology's ranks are priced with where nothing better is given: the
    catalogue's for its device name, else (a recorded dump names none) ``fallback`` (``simulate
    --preset``'s device), by default the device of the preset of its kind of GPU
    (:func:`presets.preset_for_device`); CPU ranks :data:`presets.CPU_RANK` (merges only: their
    local attention needs calibrating)."""
    dev = topo.devices[0]
    if dev.vendor == "cpu":
        return CPU_RANK
    named = device_for(dev.name)
    if named is not None:
        return named
    return fallback if fallback is not None else preset(preset_for_device(f"{dev.name} {dev.vendor}")).device


def cluster_from_topology(topo, *, device: DeviceParams | None = None, nodes: int = 1,
                          network: LinkParams | None = None, name: str | None = None) -> ClusterSpec:
    """A one-node cluster shaped like ``topo`` (its pairs' classes and hierarchy), measured numbers
    where the topology has them, repeated over ``nodes`` nodes joined by ``network``."""
    cpu = all(d.vendor == "cpu" for d in topo.devices)
    n = len(topo)
    if device is None:
        if cpu:
            raise ConfigError("a topology of CPU ranks needs the CPU device's parameters: run "
                              "benchmarks/calibrate_costmodel.py on that machine and pass --params")
        device = device_for(topo.devices[0].name)
        if device is None:
            raise ConfigError(f"the topology does not say which GPU it has (device name {topo.devices[0].name!r}): "
                              "give a --preset whose device it has")
    meas = topo.measurement
    ar_step = None
    if meas is not None and meas.allreduce_latency_us and n > 1:
        busy = meas.allreduce_latency_us - device.collective_us
        ar_step = max(0.0, busy) / (2 * (n - 1))
    pairs: dict[tuple[int, int], LinkParams] = {}
    for l in topo.links:
        cls = link_class(l, cpu)
        base = LINK_COSTS[cls]
        measured = l.bandwidth_source == "measured"
        lat = l.latency_us if measured and l.latency_us is not None else base.p2p_latency_us
        bw = l.bandwidth_gbps if l.bandwidth_gbps else base.p2p_gbps
        src = ("measured by probe --measure" if measured else
               (f"link {l.bandwidth_source} bandwidth; latencies: {base.source}" if l.bandwidth_gbps else base.source))
        pairs[(l.a, l.b)] = LinkParams(cls, lat, bw, ar_step if ar_step is not None else base.ar_step_us,
                                       min(bw, base.ar_gbps) if not measured else bw, source=src)
    hierarchy = tuple((lvl.kind, [list(g) for g in lvl.groups]) for lvl in topo.hierarchy) if n > 1 else None
    if nodes > 1 and network is None:
        network = LINK_COSTS["network"]
    return ClusterSpec(
        name or f"{n}x {topo.devices[0].name}", device, ranks_per_node=n, nodes=nodes,
        intra=None, network=network, step_overhead_us=GRAPH_STEP_US if not cpu else 0.0,
        pair_links=pairs, hierarchy=hierarchy,
        notes=(f"topology from {topo.source}" + (f", measured ({meas.method})" if meas else ", not measured"),),
    )


def cluster_from_profile(profile, **kw) -> ClusterSpec:
    """A cluster from a profile: its topology, its kernel buckets' measured bandwidth (the kernel's
    achieved fraction) and its measured plan timings (the all-reduce's per-step alpha)."""
    if profile.topology is None:
        raise ConfigError(f"profile {profile.name!r} stores no topology; simulate it with --topology or a preset")
    cluster = cluster_from_topology(profile.topology, **kw)
    dev = cluster.device
    measured = [b for b in profile.kernel.buckets if b.gbps] if profile.kernel is not None else []
    if measured:
        best = max(b.gbps for b in measured)
        frac = min(1.0, best / dev.mem_gbps)
        dev = dataclasses.replace(dev, kernel_fraction=frac,
                                  source=dev.source + f"; kernel fraction {frac:.2f} from profile {profile.name}")
    n = cluster.ranks_per_node
    ar = next((c for c in profile.reduction.candidates if c.plan.strategy == "allreduce" and c.median_us), None) \
        if profile.reduction is not None else None
    pairs = cluster.pair_links
    if ar is not None and n > 1:
        step = max(0.0, ar.median_us / 2 - dev.collective_us) / (2 * (n - 1))  # two all-reduces per merge
        note = f"; all-reduce step from profile {profile.name}"
        pairs = {k: dataclasses.replace(l, ar_step_us=step, source=l.source + note) for k, l in pairs.items()}
    return dataclasses.replace(cluster, device=dev, pair_links=pairs)


# -- parameters files ------------------------------------------------------------------------------
def cluster_to_dict(cluster: ClusterSpec) -> dict[str, Any]:
    return cluster.to_dict()


def cluster_from_dict(d: Any, where: str = "params") -> ClusterSpec:
    """The inverse of :meth:`ClusterSpec.to_dict` (unknown keys refused, every value checked)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping of cluster parameters")
    known = {"name", "nodes", "ranks_per_node", "device", "intra", "network", "step_overhead_us", "pair_links",
             "hierarchy", "notes", "measured", "ranks_per_host", "shared_nic"}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"expected some of {', '.join(sorted(known))}")
    try:
        dev = DeviceParams(**_mapping(d["device"], "device"))
        intra = LinkParams(**_mapping(d["intra"], "intra")) if d.get("intra") else None
        net = LinkParams(**_mapping(d["network"], "network")) if d.get("network") else None
        n = _whole(d["ranks_per_node"], "ranks_per_node", 1)
        pairs = {}
        pair_list = d.get("pair_links") or []
        if not isinstance(pair_list, list):
            raise ConfigError(f"pair_links: expected a list, got {pair_list!r}")
        for i, p in enumerate(pair_list):
            p = dict(_mapping(p, f"pair_links[{i}]"))
            a, b = p.pop("a"), p.pop("b")
            _whole(a, f"pair_links[{i}].a", 0, n - 1)
            _whole(b, f"pair_links[{i}].b", 0, n - 1)
            if a >= b:
                raise ConfigError(f"pair_links[{i}]: expected a < b, got a={a}, b={b}")
            pairs[(a, b)] = LinkParams(**p)
        if pairs and intra is None and len(pairs) != n * (n - 1) // 2:
            raise ConfigError(f"pair_links: {len(pairs)} pairs for {n} ranks per node, which have {n * (n - 1) // 2}; "
                              "give every pair, or an intra class for the others")
        hierarchy = _hierarchy(d.get("hierarchy"), n)
        notes = d.get("notes") or []
        if not isinstance(notes, list) or not all(isinstance(x, str) for x in notes):
            raise ConfigError(f"notes: expected a list of strings, got {notes!r}")
        return ClusterSpec(str(d.get("name", "params")), dev, n, d.get("nodes", 1), intra, net,
                           d.get("step_overhead_us", 0.0), pairs, hierarchy, tuple(notes),
                           ranks_per_host=d.get("ranks_per_host"), shared_nic=bool(d.get("shared_nic", False)))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad cluster parameters ({type(exc).__name__}: {exc})") from None


def _mapping(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: expected a mapping, got {v!r}")
    return v


def _whole(v: Any, where: str, lo: int, hi: int | None = None) -> int:
    return check_int(v, where, minimum=lo, maximum=hi, noun="a whole number")


def _hierarchy(h: Any, n: int) -> tuple | None:
    """A parameters file's ``hierarchy`` ([{kind, groups}], fastest first) as ClusterSpec keeps it."""
    if h is None:
        return None
    from ..reduce.hier_plan import hierarchical_parents

    if not isinstance(h, list) or not h:
        raise ConfigError(f"hierarchy: expected a list of levels or null, got {h!r}")
    levels = []
    for i, lvl in enumerate(h):
        lvl = _mapping(lvl, f"hierarchy[{i}]")
        kind, groups = lvl.get("kind"), lvl.get("groups")
        if not isinstance(kind, str) or not isinstance(groups, list) or not all(
                isinstance(g, list) and g and all(is_int(r) for r in g)
                for g in groups):
            raise ConfigError(f"hierarchy[{i}]: expected {{kind: text, groups: [[rank, ...], ...]}}, got {lvl!r}")
        levels.append((kind, [list(g) for g in groups]))
    hierarchical_parents(levels)  # checks the levels nest and the last covers 0..n-1 as one group
    covered = sorted(r for g in levels[-1][1] for r in g)
    if covered != list(range(n)):
        raise ConfigError(f"hierarchy: its last level covers {len(covered)} ranks, the node has {n}")
    return tuple(levels)


def load_params(path: str | os.PathLike) -> ClusterSpec:
    """A cluster from a parameters file (YAML or JSON) written by the calibration."""
    from ..files import load_yaml, yaml_problem

    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as fh:
            data = load_yaml(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read parameters file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"parameters file {p} is not text (UTF-8 YAML or JSON)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"parameters file {p} is not valid YAML or JSON: {yaml_problem(exc)}") from None
    return cluster_from_dict(data, where=p)


# -- the network between nodes, from probe --measure across them ------------------------------------
def network_from_topology(topo, *, host_link: LinkParams | None = None) -> LinkParams:
    """The ``network`` class from a topology ``probe --measure`` measured across a torchrun job's
    nodes (its ``net`` links measured pair by pair, and the all-reduce over all its ranks).

    - alpha: the median over the node pairs' ranks of the measured small-message latency (half a
      ping-pong of 8 bytes); beta: the median of their measured bandwidth (large copies). The
      slowest node pair would be the bottleneck of a ring; the median is the class's typical link
      (one class: the model's network is one link class, so a fabric with faster islands is
      priced at its typical link).
    - the all-reduce's per-step alpha: gloo's ring over all p ranks takes 2 (p - 1) steps each
      moving 1/p of the message across a node's link: the measured all-reduce less its bytes at
      beta, over 2 (p - 1).
    - the ring's bulk exchange: at beta, alpha as a message's; the part of it on a core: the host
      link's CPU time per byte (``host_link.bulk_cpu_fraction / host_link.bulk_gbps``, the
      kernel's copies are the same whichever interface the bytes leave by) at this beta.
    """
    import statistics

    from ..topology.model import LinkKind

    net = [lk for lk in topo.links if lk.kind is LinkKind.NET]
    if not net:
        raise ConfigError("the topology has no network links: measure it across nodes (probe --measure under "
                          "torchrun over several nodes)")
    if any(lk.bandwidth_source != "measured" or lk.latency_us is None for lk in net):
        raise ConfigError("the topology's network links are not measured: run probe --measure across the nodes")
    meas = topo.measurement
    alpha = statistics.median(lk.latency_us for lk in net)
    beta = statistics.median(lk.bandwidth_gbps for lk in net)
    p = len(topo)
    ar_step = alpha
    if meas is not None and meas.allreduce_latency_us:
        wire = 2 * (p - 1) / p * meas.allreduce_bytes / (beta * 1e3)
        ar_step = max(0.0, meas.allreduce_latency_us - wire) / (2 * (p - 1))
    cpu_fraction = None
    if host_link is not None and host_link.bulk_cpu_fraction and host_link.bulk_gbps:
        cpu_fraction = min(1.0, max(0.001, host_link.bulk_cpu_fraction / host_link.bulk_gbps * beta))
    how = (f"measured by probe --measure across {p} ranks ({meas.method if meas else 'unknown method'}): "
           f"median of {len(net)} cross-node pairs, latency {alpha:.0f} us ({meas.latency_bytes if meas else '?'} B), "
           f"bandwidth {beta * 8:.3f} Gbit/s ({meas.copy_bytes if meas else '?'} B copies); all-reduce of "
           f"{meas.allreduce_bytes if meas else '?'} B {meas.allreduce_latency_us if meas else 0:.0f} us")
    return LinkParams("network", p2p_latency_us=alpha, p2p_gbps=beta, ar_step_us=ar_step, ar_gbps=beta,
                      bulk_gbps=beta, bulk_latency_us=alpha, bulk_cpu_fraction=cpu_fraction, source=how)


def fabric_cluster(host: ClusterSpec, network: LinkParams, nodes: int, ranks_per_node: int) -> ClusterSpec:
    """CPU ranks of ``nodes`` x ``ranks_per_node`` whose nodes are network namespaces of one host:
    the host's calibrated ranks (:func:`tree_attn.cost.calibrate.calibrate_cpu`: the local
    attention, the merge, loopback inside a node), the measured ``network`` between the nodes, and
    every rank of the job on the host's cores (``ranks_per_host``), and each node's ranks behind
    its one link (``shared_nic``). The step's overhead stays the host's: its timed part starts as a
    rank leaves the barrier, and what the barrier leaves in it is that exit's skew, as on one host."""
    shaped = dataclasses.replace(host, network=network).with_shape(nodes, ranks_per_node)
    return dataclasses.replace(shaped, name=f"{nodes} nodes x {ranks_per_node} cpu ranks on one host",
                               ranks_per_host=nodes * ranks_per_node, shared_nic=True,
                               notes=host.notes + (f"network: {network.source}",))
