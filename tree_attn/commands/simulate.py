"""``tree-attn simulate``: predict decode steps on clusters nobody here can run, from the cost
model (``tree_attn.cost``) and parameters taken from a parameters file, a profile, a topology or a
built-in preset. No torch, nothing launched.

Parameters, from one of (two are refused): ``--params FILE`` (a calibration, e.g.
``benchmarks/calibrate_costmodel.py``), ``--profile`` (its topology, kernel bandwidths and plan
timings), ``--topology FILE`` (a probe's YAML, ``probe --measure`` numbers included, or a recorded
dump; the device and network from the preset of its kind of GPU), else the preset (default ``h100-sxm``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..cost import ClusterSpec, StepPrediction, Workload, cluster_plan, predict_step, preset
from ..dtypes import FP8, canonical, parse_kv_dtype
from ..errors import ConfigError
from ..validate import check_int, is_number
from .defaults import BATCH, HEAD_DIM, HEADS, KV_HEADS, parse_tokens

MAX_WORLD = 4096
DEFAULT_PRESET = "h100-sxm"
# The query dtypes simulate offers for --dtype (its --help says fp32, fp16, bf16), in any spelling
# dtypes.canonical reads; --kv-dtype also takes fp8.
SIMULATED_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def parse_list(text: str, what: str, parse) -> list:
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what}: expected a comma-separated list, got {text!r}")
    return sorted({parse(t) for t in items})


def parse_world(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"world size {text!r}: expected an integer") from None
    if not 1 <= n <= MAX_WORLD:
        raise ConfigError(f"world size {n}: expected 1 to {MAX_WORLD}")
    return n


@dataclass(frozen=True)
class SimulateOptions:
    """What the user asked ``simulate`` for (the CLI's defaults are these)."""

    preset: str | None = None  # None: the preset of the device a topology/profile names, else h100-sxm
    topology: str | None = None
    profile: str | None = None
    params: str | None = None
    world_sizes: str = "8,16,32,64,128"
    gpus_per_node: int | None = None
    seq_lens: str = "32K,128K,512K,1M,5.12M"  # 5.12M: the paper's longest context
    batch: int = BATCH
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "bf16"
    kv_dtype: str | None = None  # None: dtype (fp8: 1 byte per element, and its scales)
    fanout: int = 2
    step_overhead_us: float | None = None  # replaces the parameters' fixed step overhead


@dataclass
class SimRow:
    """One (world size, sequence length): the three strategies' predictions."""

    world_size: int
    nodes: int
    ranks_per_node: int
    seq_len: int
    tree: StepPrediction
    allreduce: StepPrediction
    ring: StepPrediction

    def time_us(self, strategy: str) -> float:
        return getattr(self, strategy).time_us

    @property
    def speedup(self) -> float:
        """Ring's step over the tree's."""
        return self.ring.time_us / self.tree.time_us if self.tree.time_us > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "seq_len": self.seq_len, "speedup_ring_over_tree": self.speedup,
                "tree": self.tree.to_dict(), "allreduce": self.allreduce.to_dict(), "ring": self.ring.to_dict()}


@dataclass
class SimulateResult:
    cluster_name: str
    source: str
    workload: Workload
    cluster: ClusterSpec
    rows: list[SimRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"cluster": self.cluster.to_dict(), "source": self.source,
                "workload": dataclasses.asdict(self.workload), "rows": [r.to_dict() for r in self.rows],
                "notes": list(self.notes),
                "caveat": "predictions of the cost model, not measurements"}


def resolve_cluster(opts: SimulateOptions) -> tuple[ClusterSpec, str]:
    """The parameters to simulate with, and where they came from (one line)."""
    from ..cost import fit
    from ..cost.presets import preset_for_device

    base = preset(opts.preset or DEFAULT_PRESET)

    def base_for(dev) -> ClusterSpec:
        # Without --preset, what a topology or profile lacks (the network; the device, when a
        # recorded dump names none) comes from the preset of its own kind of GPU: an MI300X
        # node's from mi300x, also when its dump names its GPUs only by vendor.
        if opts.preset is None:
            return preset(preset_for_device(f"{dev.name} {dev.vendor}"))
        return base

    def refuse_cpu_ranks(topo, what: str) -> None:
        if topo is not None and all(d.vendor == "cpu" for d in topo.devices):
            raise ConfigError(f"{what} is of CPU ranks, whose device parameters it does not hold: "
                              "run benchmarks/calibrate_costmodel.py on that machine and pass --params")

    if opts.params:
        return fit.load_params(opts.params), f"parameters file {opts.params}"
    if opts.profile:
        from ..profiles import open_profile

        prof = open_profile(opts.profile)
        refuse_cpu_ranks(prof.topology, f"profile {prof.name!r}")
        if prof.topology is not None:
            base = base_for(prof.topology.devices[0])
        device = None
        if prof.topology is not None and fit.device_for(prof.topology.devices[0].name) is None and \
                prof.topology.devices[0].vendor != "cpu":
            device = base.device
        return (fit.cluster_from_profile(prof, device=device, network=base.network),
                f"profile {prof.name} ({prof.origin}); network from preset {base.name}")
    if opts.topology:
        from ..topology import load_dump, load_topology

        path = opts.topology
        try:
            topo = load_topology(path)
        except Exception:  # noqa: BLE001 - not a topology YAML: try a recorded dump
            topo = load_dump(path)
        refuse_cpu_ranks(topo, f"topology {path}")
        base = base_for(topo.devices[0])
        device = fit.topology_device(topo, fallback=base.device)
        named = fit.device_for(topo.devices[0].name) is not None
        where = f"topology {path}" + ("" if named else f"; device from preset {base.name} (the topology names none)")
        cluster = fit.cluster_from_topology(topo, device=device, network=base.network)
        return cluster, where + f"; network from preset {base.name}"
    return base, f"built-in preset {base.name}"


def shape_for(cluster: ClusterSpec, world: int, gpus_per_node: int) -> ClusterSpec:
    """``world`` ranks in nodes of ``gpus_per_node`` (one partial node when world is smaller)."""
    if world <= gpus_per_node:
        return cluster.with_shape(1, world)
    if world % gpus_per_node:
        raise ConfigError(f"world size {world} is not a whole number of nodes of {gpus_per_node} GPUs; "
                          f"use a multiple of {gpus_per_node} (or --gpus-per-node)")
    return cluster.with_shape(world // gpus_per_node, gpus_per_node)


def simulate(opts: SimulateOptions) -> SimulateResult:
    """Predict every (world size, sequence length) of ``opts`` for tree, allreduce and ring."""
    worlds = parse_list(opts.world_sizes, "--world-sizes", parse_world)
    seqs = parse_list(opts.seq_lens, "--seq-lens", parse_tokens)
    if canonical(opts.dtype) not in SIMULATED_DTYPES:
        kv_only = canonical(opts.dtype) in FP8
        raise ConfigError(f"--dtype {opts.dtype!r}: expected fp32, fp16 or bf16"
                          + ("; fp8 holds KV caches only: give it as the KV dtype (--kv-dtype fp8)" if kv_only else ""))
    if opts.kv_dtype is not None:
        parse_kv_dtype(opts.kv_dtype)
    check_int(opts.fanout, "--fanout", minimum=2, must=True)
    if opts.fanout > max(max(worlds), 2):
        raise ConfigError(f"--fanout {opts.fanout} is larger than the largest world size {max(worlds)}; "
                          f"use 2..{max(max(worlds), 2)}")
    given = [name for name, v in (("--params", opts.params), ("--profile", opts.profile),
                                  ("--topology", opts.topology)) if v]
    if len(given) > 1:
        raise ConfigError(f"give one source of parameters, not {' and '.join(given)}: each holds the node's links")
    cluster, source = resolve_cluster(opts)
    if opts.step_overhead_us is not None:
        over = opts.step_overhead_us
        if not is_number(over) or not 0 <= over <= 1e9:
            raise ConfigError(f"--step-overhead-us must be a number of microseconds from 0 to 1e9; got {over!r}")
        cluster = dataclasses.replace(cluster, step_overhead_us=float(over))
        source += f"; step overhead set to {over:g} us"
    g = cluster.ranks_per_node if opts.gpus_per_node is None else opts.gpus_per_node
    check_int(g, "--gpus-per-node", minimum=1, maximum=MAX_WORLD, must=True)
    if cluster.pair_links and g != cluster.ranks_per_node:
        raise ConfigError(f"the topology describes nodes of {cluster.ranks_per_node} devices; --gpus-per-node {g} "
                          "would invent the rest: omit it")
    if g < max(worlds) and cluster.network is None:
        more = (f", or --gpus-per-node {max(worlds)}: ranks of one host beyond its {cluster.device.shared_cores} "
                "cores share them, as the model prices"
                if cluster.device.shared_cores and not cluster.pair_links else "")
        raise ConfigError(f"world sizes above {g} need several nodes, and these parameters have no network class; "
                          f"use world sizes up to {g}{more}")
    workload = Workload(seqs[0], opts.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.dtype, opts.kv_dtype)
    result = SimulateResult(cluster.name, source, workload, cluster)
    for world in worlds:
        c = shape_for(cluster, world, g)
        plan = cluster_plan(c, opts.fanout)
        for n in seqs:
            w = dataclasses.replace(workload, seq_len=n)
            result.rows.append(SimRow(world, c.nodes, c.ranks_per_node, n, predict_step(c, w, "tree", plan),
                                      predict_step(c, w, "allreduce"), predict_step(c, w, "ring")))
        mem = cluster.device.memory_bytes
        if mem:
            result.notes.extend(memory_notes([r for r in result.rows if r.world_size == world], mem))
    result.notes.extend(cluster.notes)
    return result


def memory_notes(rows: list[SimRow], mem: int) -> list[str]:
    """What does not fit in a device's ``mem`` bytes at one world size: the KV shard itself (then
    no strategy runs), else ring's shard plus its blocks in flight."""
    world = rows[0].world_size
    shard = {r.seq_len: r.tree.peak_mem_bytes - r.tree.extra_mem_bytes for r in rows}  # the largest KV shard
    too_big = sorted(n for n, b in shard.items() if b > mem)
    if too_big:
        return [(f"{world} GPUs: from {too_big[0]:,} tokens the KV shard alone ({shard[too_big[0]] / 2**30:,.1f} GiB "
                 f"per rank) exceeds the device's {mem / 2**30:,.1f} GiB: no strategy runs there")]
    worst = max(rows, key=lambda r: r.ring.peak_mem_bytes)
    if worst.ring.peak_mem_bytes > mem:
        flying = min(2, world - 1)
        return [(f"{world} GPUs: ring's peak per rank (KV shard + {flying} block{'s' if flying > 1 else ''} in flight) "
                 f"reaches {worst.ring.peak_mem_bytes / 2**30:,.1f} GiB at {worst.seq_len:,} tokens, beyond the "
                 f"device's {mem / 2**30:,.1f} GiB")]
    return []
