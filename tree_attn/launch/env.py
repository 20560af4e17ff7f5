"""Where a process sits in a job: the rank environment, torchrun's variables, device kind and
backend, and the limits on CPU ranks. Imports nothing of the project but ``errors`` (torch only
inside :func:`gpu_count`), so every layer may use it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import ConfigError
from ..validate import check_int, is_number

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
# How long a collective may wait for a peer (torch's own timeout inside the ranks; the parent's
# limit on a spawned rank's silence is this plus a margin): the one default of every --timeout.
DEFAULT_TIMEOUT_S = 120.0

# CPU ranks: each is a process with its own torch (about 250 MiB) and at least one thread.
# Beyond a few per core they only queue for the cores; 64 bounds the process count anywhere.
CPU_RANKS_PER_CORE = 4
MAX_CPU_RANKS = 64


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_cpu_ranks() -> int:
    """The most CPU ranks tree-attn starts on this machine: 4 per core, at least 8, at most 64."""
    return min(MAX_CPU_RANKS, max(8, CPU_RANKS_PER_CORE * usable_cores()))


def check_cpu_ranks(n: int, what: str = "--world-size") -> None:
    """Refuse a CPU rank count that is not a positive integer or beyond :func:`max_cpu_ranks`,
    before anything is built for it (a topology of n ranks has n (n - 1) / 2 links)."""
    check_int(n, what, minimum=1, must=True)
    limit = max_cpu_ranks()
    if n > limit:
        cores = usable_cores()
        raise ConfigError(
            f"{what} {n}: at most {limit} CPU ranks on this machine ({cores} core{'s' if cores != 1 else ''}; "
            f"each rank is a process with its own torch, and beyond {CPU_RANKS_PER_CORE} per core, or "
            f"{MAX_CPU_RANKS} in all, they only wait for the cores); use {what} {limit} or fewer ({what} "
            f"{min(limit, cores)}, one rank per core, gives the steadiest timings)"
        )


def oversubscription_warning(n: int, timed: str = "step times") -> str | None:
    """Plain words when ``n`` CPU ranks outnumber the usable cores (their ``timed`` then swing
    widely between runs: each rank waits for the others' cores), with a world size that fits."""
    cores = usable_cores()
    if n <= cores:
        return None
    return (f"{n} CPU ranks share {cores} core{'s' if cores != 1 else ''}: ranks wait for each other's cores, so "
            f"{timed} swing widely from run to run; -w {cores} gives steadier timings")


def check_timeout(timeout_s: float, what: str = "--timeout") -> None:
    """A collective timeout must be a positive, finite number of seconds (at most ~11 days)."""
    if not is_number(timeout_s) or not math.isfinite(timeout_s) or not 0 < timeout_s <= 1e6:
        raise ConfigError(f"{what} must be a number of seconds in (0, 1e6]; got {timeout_s!r}")



@dataclass(frozen=True)
class RankEnv:
    """Where this process sits: rank, world size, backend and the torch device it computes on."""

    rank: int
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda:<local index>"
    local_rank: int = 0


def gpu_count() -> int:
    """Visible CUDA/ROCm GPUs (0 without torch.cuda)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device_kind(device: str) -> tuple[str, int]:
    """``(device kind, visible GPUs)`` for ``device`` = auto | cpu | cuda.

    ``auto`` is ``cuda`` when torch sees a GPU (CUDA or ROCm), else ``cpu``. ``cuda`` without a
    visible GPU is a :class:`ConfigError`.
    """
    if device not in DEVICES:
        raise ConfigError(f"--device must be auto, cpu or cuda; got {device!r}")
    n_gpus = gpu_count()
    kind = ("cuda" if n_gpus > 0 else "cpu") if device == "auto" else device
    if kind == "cuda" and n_gpus == 0:
        raise ConfigError("--device cuda asked for, but no GPU is visible to torch")
    return kind, n_gpus


def resolve_backend(backend: str, device_kind: str) -> str:
    """gloo for CPU ranks, nccl (RCCL on ROCm builds of torch) for GPU ranks."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "nccl" if device_kind == "cuda" else "gloo"
    if backend == "nccl" and device_kind != "cuda":
        raise ConfigError("the nccl backend needs GPU ranks; use --backend gloo (or auto) on CPU ranks")
    if backend == "gloo" and device_kind == "cuda":
        # gloo has no point-to-point sends of GPU tensors (torch.distributed's backend table),
        # and the tree and the ring are made of them.
        raise ConfigError("the gloo backend cannot send GPU tensors point to point; use --backend nccl (or auto) "
                          "on GPU ranks, or --device cpu for CPU ranks over gloo")
    return backend


def _env_int(name: str, default: str | None = None) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}={raw!r} is not an integer; torchrun sets RANK, WORLD_SIZE and LOCAL_RANK: outside torchrun "
            "unset them (they make tree-attn join a torchrun job)"
        ) from None


def rank_cuda_device(local_rank: int, visible: int) -> str:
    """The GPU of a torchrun rank: ``cuda:<local_rank>`` when this process sees the node's GPUs,
    ``cuda:0`` when it sees exactly one (launchers that give each process its own GPU, such as
    SLURM's ``--gpus-per-task=1``, renumber it 0 in every process). A LOCAL_RANK beyond several
    visible GPUs is a ConfigError (CUDA's "invalid device ordinal" otherwise)."""
    if visible == 1:
        return "cuda:0"
    if visible < 1:
        raise ConfigError("GPU ranks asked for, but no GPU is visible to this process (CUDA_VISIBLE_DEVICES?); "
                          "use --device cpu for CPU ranks")
    if local_rank >= visible:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs (cuda:0..cuda:{visible - 1}): start at most "
            f"{visible} ranks per node (torchrun --nproc-per-node {visible}), or give each process one GPU"
        )
    return f"cuda:{local_rank}"


def torchrun_env(device_kind: str | None = None, backend: str = "auto") -> RankEnv | None:
    """The rank environment set by torchrun (RANK, WORLD_SIZE, LOCAL_RANK), or None.

    ``device_kind`` ("cpu" / "cuda"; None = a GPU when one is visible) and ``backend`` are the
    run's own choices, so ``--device cpu`` under torchrun on a GPU host runs CPU ranks over gloo.
    A variable that is not an integer or out of range is a ConfigError naming it (stale
    variables left in a shell are the usual cause).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK", "0")
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be at least 1 (torchrun sets it; outside torchrun unset it)")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} must lie in 0..WORLD_SIZE-1={world - 1} (torchrun sets it; outside torchrun "
                          "unset it)")
    if local < 0:
        raise ConfigError(f"LOCAL_RANK={local} must be >= 0 (torchrun sets it; outside torchrun unset it)")
    visible = gpu_count()
    kind = device_kind if device_kind is not None else ("cuda" if visible > 0 else "cpu")
    device = rank_cuda_device(local, visible) if kind == "cuda" else "cpu"
    return RankEnv(rank=rank, world_size=world, backend=resolve_backend(backend, kind), device=device, local_rank=local)


@dataclass(frozen=True)
class NodeLayout:
    """How a torchrun job's ranks sit on nodes: ``nodes`` x ``ranks_per_node``, node n holding
    ranks ``n * ranks_per_node .. (n + 1) * ranks_per_node - 1`` (torchrun numbers ranks node by
    node); ``node`` is this process's node (torchrun's GROUP_RANK)."""

    nodes: int
    ranks_per_node: int
    node: int = 0


def torchrun_layout(env: RankEnv) -> NodeLayout:
    """The node layout of a torchrun job from LOCAL_WORLD_SIZE and GROUP_RANK (one node when
    they are absent). Every rank derives the same layout without talking to the others, so the
    job's reduction plan agrees across ranks. Nodes with different rank counts, or ranks not
    numbered node by node, are a ConfigError: the plan could not be agreed on."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return NodeLayout(1, env.world_size, 0)
    local_world = _env_int("LOCAL_WORLD_SIZE")
    group_rank = _env_int("GROUP_RANK", "0")
    if local_world < 1 or env.world_size % local_world:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local_world} does not divide WORLD_SIZE={env.world_size}: give every node the same "
            "--nproc-per-node (tree-attn plans the tree from equal nodes)"
        )
    nodes = env.world_size // local_world
    if env.rank // local_world != group_rank or env.local_rank != env.rank % local_world:
        raise ConfigError(
            f"RANK={env.rank} is not rank {env.local_rank} of node GROUP_RANK={group_rank} with {local_world} ranks "
            "per node: tree-attn expects torchrun's numbering, node by node"
        )
    return NodeLayout(nodes, local_world, group_rank)



def torchrun_rendezvous(env: RankEnv) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` of a torchrun job; a ConfigError naming the variable when
    one is missing or not a port (RANK and WORLD_SIZE left in a shell without torchrun)."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ConfigError(
                f"{name} is not set, but RANK={env.rank} and WORLD_SIZE={env.world_size} are: torchrun sets all of "
                "them; outside torchrun unset RANK and WORLD_SIZE"
            )
    port = _env_int("MASTER_PORT")
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return os.environ["MASTER_ADDR"], port

