"""Resolve the options of ``tree-attn tune`` into a :class:`TuneSetup`.

:func:`plan_tune` decides what is tuned (the topology: a file, CPU ranks, or this machine's GPUs;
the shapes) and where the profile goes, and refuses an existing output file (without ``force``)
before anything is timed. A topology of this machine is launched: its ranks are resolved by
:func:`tree_attn.launch.setup.resolve_launch` (spawned, never joining torchrun); another machine's
is only described, and :func:`~.profile.build_profile` models it. Nothing here prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import ConfigError, ProfileError, TopologyError
from ...launch.setup import LaunchOptions
from ...validate import check_int
from ..defaults import BATCH, HEAD_DIM, HEADS, KV_HEADS

if TYPE_CHECKING:  # pragma: no cover
    from ...topology import Topology
    from .timing import TuneOptions

__all__ = ["TuneRequest", "TuneSetup", "check_output_free", "plan_tune"]


def _plan_torchrun_tune(request: TuneRequest, dtype: str, device_kind: str, kv_dtype: str | None = None) -> TuneSetup:
    """``tune`` as one rank of a torchrun job: the job's ranks time the candidate plans over the
    job's own process group (across its nodes). The topology is ``--topology FILE`` (typically
    what ``probe --measure -o FILE`` measured in the same job: its hierarchy follows the
    measurement) or the job's node layout (each node, then the network). Only the plans are
    timed (kernel configs are a node's own: ``tune`` them on one node); rank 0 writes the profile."""
    from ...launch.plans import layout_topology
    from ...launch.setup import resolve_launch
    from ...profiles import profile_path_for
    from .timing import TuneOptions

    launch = resolve_launch(request.launch_request(world_size=None, dtype=dtype, kv_dtype=kv_dtype, join_torchrun=True,
                                                   activity="tuning for", timed="plan timings"))
    if request.topology_file:
        from ...topology import load_expected

        topo = load_expected(request.topology_file)
    else:
        topo = layout_topology(launch.layout, device_kind)
    if len(topo) != launch.world_size:
        raise ConfigError(f"the topology has {len(topo)} devices, the torchrun job {launch.world_size} ranks: give "
                          "--topology a file measured in a job of the same size (probe --measure -o FILE)")
    output = request.output or str(profile_path_for(topo.fingerprint))
    if launch.rank == 0:
        check_output_free(output, request.force)
    notices = [*launch.notices, *launch.warnings,
               f"torchrun job of {launch.nodes} node(s) x {launch.layout.ranks_per_node} ranks: timing the reduction "
               f"plans across the job (hierarchy from {topo.hierarchy_source}"
               + (f", {request.topology_file}" if request.topology_file else "") + "); kernel configs are not tuned "
               "under torchrun (tune them on one node)"]
    options = TuneOptions(launch=launch, batch=request.batch, q_heads=request.heads, kv_heads=request.kv_heads,
                          head_dim=request.head_dim, kv_dtype=kv_dtype, quick=request.quick, tune_kernels=False)
    return TuneSetup(topology=topo, options=options, measurable=True, output=output, force=request.force,
                     notices=tuple(notices))


@dataclass(frozen=True)
class TuneRequest(LaunchOptions):
    """What the user asked ``tune`` for: the launch (:class:`LaunchOptions`; the dtype is the
    kernel's), the topology, the shapes, where the profile goes. These are the defaults of
    ``tree-attn tune``."""

    dtype: str = "bf16"  # what checkpoints ship in; the kernel is tuned per dtype
    kv_dtype: str | None = None  # the KV cache's (fp8: the fp8 buckets); None: dtype's
    topology_file: str | None = None
    output: str | None = None
    force: bool = False
    quick: bool = False
    batch: int = BATCH
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM


@dataclass(frozen=True)
class TuneSetup:
    """A resolved tune: the topology, the timing options (their launch: the ranks that time it, or
    that it describes when this machine cannot), whether this machine can time it, where the
    profile goes, and notices for the user."""

    topology: Topology
    options: TuneOptions
    measurable: bool
    output: str
    force: bool = False
    notices: tuple[str, ...] = ()
    model_reason: str | None = None  # why nothing can be timed here (when not measurable)


def _kind_of(topo: Topology) -> str:
    from ...profiles.schema import device_kind_of

    return "cuda" if device_kind_of(topo) in ("cuda", "rocm") else "cpu"


def _topology(request: TuneRequest, device_kind: str) -> Topology:
    """The topology to tune: the file's, ``--world-size`` CPU ranks, or this machine's GPUs."""
    from ...launch.env import check_cpu_ranks
    from ...topology import host_topology, load_expected, probe_topology
    from ...topology.host import default_cpu_ranks

    if request.topology_file:
        return load_expected(request.topology_file)
    if device_kind == "cpu":
        n = request.world_size if request.world_size is not None else default_cpu_ranks()
        check_cpu_ranks(n)  # before a topology of n ranks is built
        return host_topology(n)
    topo = probe_topology("auto")
    if topo.source == "host":
        raise TopologyError(
            "torch sees GPUs but their fabric could not be probed (NVML / AMD SMI unavailable, see the note above); "
            "install nvidia-ml-py (or amdsmi), give the fabric with --topology FILE, or tune CPU ranks with "
            "--device cpu"
        )
    return topo


def check_output_free(path: str, force: bool) -> None:
    """Refuse to tune into an existing file without ``force``, or into a path that cannot be
    written (before any timing, not after)."""
    from ...files import unwritable

    problem = unwritable(path)
    if problem:
        raise ProfileError(f"cannot write the profile {path}: {problem}; give another --output FILE")
    if os.path.exists(path) and not force:
        raise ProfileError(f"{path} already exists; pass --force to overwrite it (or write elsewhere with "
                           "--output FILE)")


def plan_tune(request: TuneRequest) -> TuneSetup:
    """Resolve ``request`` against this machine. Raises ConfigError for bad options, TopologyError
    for an unreadable topology, ProfileError when the output exists (without ``force``)."""
    from ...dtypes import parse_dtype, parse_kv_dtype
    from ...launch.env import check_timeout, resolve_backend, resolve_device_kind, torchrun_env
    from ...launch.memory import check_host_memory
    from ...launch.setup import LaunchSetup, resolve_launch
    from ...profiles import profile_path_for
    from .timing import TuneOptions

    check_timeout(request.timeout_s)
    for option, value in (("--batch", request.batch), ("--heads", request.heads), ("--kv-heads", request.kv_heads),
                          ("--head-dim", request.head_dim)):
        check_int(value, option, minimum=1, must=True)
    if request.heads % request.kv_heads:
        raise ConfigError(f"query heads ({request.heads}) must be a multiple of KV heads ({request.kv_heads})")
    dtype = parse_dtype(request.dtype)
    kv_dtype = None if request.kv_dtype is None else parse_kv_dtype(request.kv_dtype)
    # The device kind picks the topology (CPU ranks or the probed GPUs), whose size is the world's.
    device_kind, n_gpus = resolve_device_kind(request.device)
    if torchrun_env(device_kind, request.backend) is not None:
        return _plan_torchrun_tune(request, dtype, device_kind, kv_dtype)
    topo = _topology(request, device_kind)
    world = len(topo)
    if request.world_size is not None and request.world_size != world:
        raise ConfigError(f"--world-size {request.world_size} does not match the topology's {world} devices")
    output = request.output or str(profile_path_for(topo.fingerprint))
    check_output_free(output, request.force)

    local_kind = _kind_of(topo)
    reason = None
    if local_kind != device_kind:
        reason = f"its devices are {'GPUs' if local_kind == 'cuda' else 'CPU ranks'}, the ranks here would be " \
                 f"{'GPUs' if device_kind == 'cuda' else 'CPU ranks'}"
    elif device_kind == "cuda" and world > n_gpus:
        reason = f"it has {world} GPUs, torch sees {n_gpus} here"
    probed = topo.notes if device_kind == "cuda" and not request.topology_file else ()
    if reason is None:
        launch = resolve_launch(request.launch_request(world_size=world, dtype=dtype, kv_dtype=kv_dtype,
                                                       join_torchrun=False, activity="tuning for",
                                                       timed="plan timings"))
        notices = [*probed, *launch.notices, *launch.warnings]
        if device_kind == "cpu":  # the plans' messages, before any rank allocates them
            check_host_memory(world, 0, request.batch, request.kv_heads, request.head_dim, dtype, False, request.heads)
    else:
        # Nothing is started: the launch only describes the topology's ranks for the model.
        backend = resolve_backend(request.backend, device_kind)
        launch = LaunchSetup(world_size=world, device_kind=device_kind, backend=backend, timeout_s=request.timeout_s,
                             dtype=dtype, kv_dtype=kv_dtype)
        notices = [*probed, (f"the topology ({world} x {topo.devices[0].name}) is not this machine ({reason}): "
                             "nothing can be timed here, so the profile is model-derived (origin: model)")]
    options = TuneOptions(launch=launch, batch=request.batch, q_heads=request.heads, kv_heads=request.kv_heads,
                          head_dim=request.head_dim, kv_dtype=kv_dtype, quick=request.quick)
    return TuneSetup(topology=topo, options=options, measurable=reason is None, output=output,
                     force=request.force, notices=tuple(notices), model_reason=reason)
