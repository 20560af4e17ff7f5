"""Launching ranks: spawn one process per rank (CPU/gloo or one GPU each), or join a torchrun job.

``launch_ranks(fn, world_size)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh
processes with torch.distributed initialised (file:// rendezvous in a private temp dir, so no
ports are needed; gloo bound to the loopback interface, so a single-host job opens no socket on
the network) and returns each rank's result in rank order. If a rank raises or dies, the others
are stopped and a :class:`DistributedError` names the rank and its error: the parent never hangs
waiting for a dead peer.

Faults, and how each ends:

- A hung or stopped peer: collectives inside the ranks fail after ``timeout_s``: the ones the
  host issues by torch's own timeout (gloo; NCCL's watchdog), the NCCL work replayed from a
  CUDA graph, which no watchdog sees, by the bounded wait that follows every replay
  (``graphs.wait_for``: on expiry it aborts the communicator and names the rank and the step).
  The parent bounds silence, not work: each rank beats a heartbeat (a thread, every 0.5 s) and
  the parent gives up on a rank only after ``timeout_s`` + :data:`SILENCE_MARGIN_S` without one
  (a SIGSTOPped rank), however long a healthy run takes.
- The end: a rank whose work succeeded waits at a barrier (at most ``timeout_s``) before it
  tears its group down, so no rank destroys its communicator while a peer still moves data
  through it; a peer that never arrives gets the group aborted, not waited for. A failing rank
  tears down at once (its peers may be stuck in a collective that will never complete).
- The parent dies (kill -9, a crash): every rank watches its parent (Linux: the parent-death
  signal, ``prctl(PR_SET_PDEATHSIG)``; everywhere: a thread polling ``os.getppid()``), removes the
  rendezvous folder and exits.
- The parent stops early (an error, Ctrl-C, SIGTERM turned into KeyboardInterrupt by the CLI):
  its ``finally`` kills every rank (SIGKILL: a rank blocked in a collective or on a full result
  pipe cannot run a handler) and removes the folder. Until then it keeps draining the result
  queue, so no rank blocks writing a large result.
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, DistributedError, TreeAttnError

# Spawned ranks import this module before torch (it holds their entry point): without numpy (an
# optional dependency) torch would warn "Failed to initialize NumPy" once per rank. Ranks never
# hand torch numpy arrays. (The CLI sets the same filter for its own process.)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

BACKENDS = ("auto", "gloo", "nccl")

HEARTBEAT_S = 0.5  # how often a rank beats (and checks that its parent lives)
# Silence the parent tolerates beyond the collective timeout before it gives a rank up.
SILENCE_MARGIN_S = 30.0
# Before its first heartbeat a rank is still starting: spawning and importing torch take seconds,
# more with many ranks on few cores. This much more silence is allowed then.
STARTUP_S = 120.0
# A rank quiet this long when another rank fails is named in the error (likely the cause).
QUIET_S = 3.0

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
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{what} must be an integer >= 1; got {n!r}")
    limit = max_cpu_ranks()
    if n > limit:
        cores = usable_cores()
        raise ConfigError(
            f"{what} {n}: at most {limit} CPU ranks on this machine ({cores} core{'s' if cores != 1 else ''}; "
            f"each rank is a process with its own torch, and beyond {CPU_RANKS_PER_CORE} per core, or "
            f"{MAX_CPU_RANKS} in all, they only wait for the cores); use {what} {min(limit, cores)}"
        )


def oversubscription_warning(n: int) -> str | None:
    """Plain words when ``n`` CPU ranks outnumber the usable cores (their timings then swing
    widely between runs: each rank waits for the others' cores), with a world size that fits."""
    cores = usable_cores()
    if n <= cores:
        return None
    return (f"{n} CPU ranks share {cores} core{'s' if cores != 1 else ''}: ranks wait for each other's cores, so "
            f"step times swing widely from run to run; -w {cores} gives steadier timings")


def check_timeout(timeout_s: float, what: str = "--timeout") -> None:
    """A collective timeout must be a positive, finite number of seconds (at most ~11 days)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= 1e6:
        raise ConfigError(f"{what} must be a number of seconds in (0, 1e6]; got {timeout_s!r}")


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in names:
        if name == "lo":
            return name
    return next((name for name in names if name.startswith("lo")), None)


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


def resolve_backend(backend: str, device_kind: str) -> str:
    """gloo for CPU ranks, nccl (RCCL on ROCm builds of torch) for GPU ranks."""
    from ..errors import ConfigError

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
        raise ConfigError(f"RANK={rank} must lie in 0..WORLD_SIZE-1={world - 1} (torchrun sets it; outside torchrun unset it)")
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
            f"RANK={env.rank} is not rank {env.local_rank} of node GROUP_RANK={group_rank} with {local_world} ranks per "
            "node: tree-attn expects torchrun's numbering, node by node"
        )
    return NodeLayout(nodes, local_world, group_rank)


def _init_process_group(backend: str, device: str, **kwargs) -> None:
    """``init_process_group`` with a GPU rank's device made current and bound (``device_id``).

    Binding the device tells NCCL which GPU this rank drives, so barriers and collectives need
    not guess it (torch warns "Guessing device ID based on global rank" and "barrier(): using the
    device under current context" otherwise), and creates the communicator eagerly. The tree's
    concurrent receives then share that communicator, which is why ``reduce.merges`` posts a
    node's receives from all its children as one batch (one NCCL group: they progress together).
    """
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        dev = torch.device(device)
        torch.cuda.set_device(dev)
        if backend == "nccl":
            kwargs["device_id"] = dev
    dist.init_process_group(backend, **kwargs)


def barrier(env: RankEnv) -> None:
    """``dist.barrier()`` naming this rank's GPU on NCCL (no device guess, no warning)."""
    import torch.distributed as dist

    if env.backend == "nccl" and env.device.startswith("cuda"):
        dist.barrier(device_ids=[int(env.device.split(":")[1])])
    else:
        dist.barrier()


def close_process_group(clean: bool | None = None, timeout_s: float | None = None) -> None:
    """Tear the default process group down cleanly: drop tree-attn's cached merges (they hold the
    group), collect what still refers to it, wait for the peers at a barrier, then
    ``destroy_process_group``.

    Args:
        clean: this rank's work succeeded, so its peers are expected at the barrier. False (a
            rank that failed): no barrier, its peers may never come, and an NCCL group is
            aborted rather than destroyed (destroying flushes work a stuck peer never completes).
            None: clean unless an exception is propagating (called from a ``finally``).
        timeout_s: the longest wait at the barrier (default: the group's own timeout). A peer
            that does not come in time gets the group aborted, not destroyed (NCCL's destroy
            would wait for it), with a warning.

    Without the cache drop, a gloo group kept alive by a cache is destroyed only at interpreter
    exit, and tearing down its worker threads there aborted about one torchrun rank in twelve with
    "terminate called without an active exception" (SIGABRT) on a loaded 2-core machine. Without
    the barrier, a rank could destroy its communicator while a peer still sends through it.
    """
    import gc

    import torch.distributed as dist

    from ..graphs import free_communicating_graphs
    from ..reduce.collectives import abort_group, clear_merge_cache, group_timeout_s

    clear_merge_cache()
    gc.collect()
    if not dist.is_initialized():
        return
    if clean is None:
        clean = sys.exc_info()[1] is None
    if not clean and dist.get_backend() == "nccl":
        # A failing rank's peers may be stuck in a collective that never completes: NCCL's
        # destroy flushes outstanding work (ncclCommFinalize) and would wait for it; abort does not.
        abort_group()
        return
    if clean and dist.get_world_size() > 1:
        limit = timeout_s if timeout_s is not None else (group_timeout_s() or DEFAULT_TEARDOWN_S)
        if not _teardown_barrier(limit):
            rank = dist.get_rank()
            did = abort_group()
            warnings.warn(f"rank {rank}: a peer did not reach the end of the job within {limit:g} s; {did} "
                          "instead of torn down", RuntimeWarning, stacklevel=2)
            return
    # Graphs still holding NCCL kernels (a step its owner never closed) would hang the teardown:
    # after the barrier every rank's work is done, so they are freed here.
    free_communicating_graphs("its process group was torn down")
    dist.destroy_process_group()


# The barrier before teardown, when the group does not say its timeout.
DEFAULT_TEARDOWN_S = 120.0
# The barrier's own timeout and our wait for it differ by this much, so that the intended one
# ends the wait (see _teardown_barrier).
TEARDOWN_GRACE_S = 5.0


def _teardown_barrier(timeout_s: float) -> bool:
    """A barrier of the default group, waited for at most about ``timeout_s``; whether every rank
    came. NCCL: our poll ends first, since NCCL's watchdog would end a barrier past its own
    timeout by killing the process; gloo: the barrier's own timeout ends it first, since a gloo
    group cannot be torn down while its worker thread still runs one."""
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    own, poll = (timeout_s + TEARDOWN_GRACE_S, timeout_s) if nccl else (timeout_s, timeout_s + TEARDOWN_GRACE_S)
    try:
        work = dist.barrier(async_op=True, timeout=datetime.timedelta(seconds=own))
        deadline = time.monotonic() + poll
        while not work.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        work.wait()
        return True
    except Exception:  # noqa: BLE001 - a peer gone (connection closed) or a timeout: not clean
        return False


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


def _reach_store(addr: str, port: int, timeout_s: float) -> bool:
    """Whether the job's store at ``addr:port`` accepts a connection within ``timeout_s``.
    torch's own client retries past its timeout (about 3x) and logs C++ stack traces on the way."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def init_torchrun(env: RankEnv, timeout_s: float) -> None:
    """Initialise the default process group from torchrun's environment (env:// rendezvous).

    Missing MASTER_ADDR / MASTER_PORT, or a job whose other ranks never come (within
    ``timeout_s``), are errors naming the variables, not torch's tracebacks.
    """
    addr, port = torchrun_rendezvous(env)
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    hint = "are the other ranks running? Outside torchrun unset RANK and WORLD_SIZE"
    # Rank 0 hosts the store, unless torchrun's agent does (then every rank is a client).
    client = env.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if client and not _reach_store(addr, port, timeout_s):
        raise DistributedError(
            f"no torchrun job answers at {where} (RANK={env.rank} of WORLD_SIZE={env.world_size}) within {timeout_s:g} s; {hint}"
        )
    try:
        _init_process_group(env.backend, env.device, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    except TreeAttnError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError, RuntimeError, ValueError...
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise DistributedError(
            f"could not join the torchrun job at {where} as RANK={env.rank} of WORLD_SIZE={env.world_size} within "
            f"{timeout_s:g} s ({type(exc).__name__}: {first}); {hint}"
        ) from exc


def _remove_rendezvous(rdzv_dir: str) -> None:
    """Remove the rendezvous folder (a peer's store may still be writing in it: try again)."""
    for _ in range(5):
        shutil.rmtree(rdzv_dir, ignore_errors=True)
        if not os.path.exists(rdzv_dir):
            return
        time.sleep(0.05)


def _orphaned(rdzv_dir: str) -> None:
    """The parent is gone: remove the rendezvous folder it can no longer remove, and exit now."""
    _remove_rendezvous(rdzv_dir)
    os._exit(1)


def _watch_parent(parent_pid: int, rdzv_dir: str) -> None:
    """Die with the parent (kill -9 of ``tree-attn run`` must not leave ranks behind).

    Linux: the parent-death signal (SIGTERM, handled below) arrives the moment the parent exits;
    everywhere: the heartbeat thread polls ``os.getppid()``. A rank blocked in a collective does
    not run Python signal handlers, but its heartbeat thread still runs (torch releases the GIL
    while it waits).
    """
    def on_term(signum, frame):  # the parent's death signal, or a plain SIGTERM
        # The death signal comes when the thread that started this rank ends: under kill -9 the
        # parent's other threads may still be dying, and getppid() still names it for a moment.
        deadline = time.monotonic() + 1.0
        while os.getppid() == parent_pid and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.getppid() != parent_pid:
            _orphaned(rdzv_dir)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the heartbeat thread's poll remains
            pass
    if os.getppid() != parent_pid:  # died before the signal was armed
        _orphaned(rdzv_dir)


def _heartbeat(rank: int, beats, parent_pid: int, rdzv_dir: str) -> None:
    """Beat every HEARTBEAT_S into ``beats[rank]`` (monotonic seconds) and check the parent."""
    while True:
        if os.getppid() != parent_pid:
            _orphaned(rdzv_dir)
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def _child(
    rank: int,
    world_size: int,
    backend: str,
    device_kind: str,
    init_file: str,
    timeout_s: float,
    fn: Callable,
    args: tuple,
    results,
    beats,
    parent_pid: int,
) -> None:
    rdzv_dir = os.path.dirname(init_file)
    ok = False  # fn returned and its result went out: teardown may wait for the peers
    _watch_parent(parent_pid, rdzv_dir)
    beats[rank] = time.monotonic()  # started: from now on the silence limit applies
    threading.Thread(target=_heartbeat, args=(rank, beats, parent_pid, rdzv_dir), name="tree-attn-heartbeat",
                     daemon=True).start()
    # A self-launched job lives on this host: gloo listens on the loopback interface only (by
    # default it binds to whatever the host name resolves to, possibly an outside address).
    # torchrun jobs keep the user's settings (init_torchrun does not come here).
    lo = loopback_interface()
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo

    import torch

    try:
        device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
        if device_kind != "cuda":
            # Ranks share the host's cores: one intra-op thread each avoids oversubscription.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        _init_process_group(
            backend,
            device,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        env = RankEnv(rank, world_size, backend, device, rank)
        value = fn(env, *args)
        # Plain pickle, not torch's shared-memory reductions: those hand over file descriptors
        # that vanish once this process exits, before the parent may have read them.
        results.put(("ok", rank, pickle.dumps(value)))
        ok = True
    except TreeAttnError as exc:
        results.put(("error", rank, type(exc).__name__, str(exc), traceback.format_exc()))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, type(exc).__name__, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        try:
            # After success: a barrier first (bounded by timeout_s), so this rank's teardown never
            # cuts a peer's last messages short; after a failure: at once.
            close_process_group(clean=ok, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001
            pass
        if os.getppid() != parent_pid:  # the parent died while this rank was failing or finishing
            _remove_rendezvous(rdzv_dir)


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    device_kind: str = "cpu",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(env: RankEnv, *args)`` on ``world_size`` spawned ranks; return results by rank.

    Args:
        fn: a module-level (picklable) function.
        backend: "gloo" or "nccl" (or "auto").
        device_kind: "cpu" or "cuda" (one GPU per rank).
        timeout_s: the collective timeout inside the ranks; the parent gives a rank up after
            ``timeout_s`` + :data:`SILENCE_MARGIN_S` without a heartbeat from it (not after a
            total time: a long healthy run is never cut).

    Raises:
        DistributedError: a rank raised, died or fell silent; the message names the rank and the cause.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be at least 1; got {world_size}")
    check_timeout(timeout_s, "timeout_s")
    backend = resolve_backend(backend, device_kind)
    if device_kind == "cuda":
        n = gpu_count()
        if world_size > n:
            raise ConfigError(f"world size {world_size} needs {world_size} GPUs; this machine has {n}")
    else:
        check_cpu_ranks(world_size, "world size")
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tree-attn-rdzv-")
    init_file = os.path.join(tmp, "rendezvous")
    results = ctx.Queue()
    beats = ctx.Array("d", world_size, lock=False)  # last heartbeat per rank (time.monotonic)
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, backend, device_kind, init_file, timeout_s, fn, args, results, beats, os.getpid()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        started = time.monotonic()
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, beats, started, silence_s=timeout_s + SILENCE_MARGIN_S)
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(procs) -> None:
    """Kill every rank still alive and reap them all (a stopped rank too: SIGKILL ends it)."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                p.kill()
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.1, deadline - time.monotonic()))


def _quiet_ranks(beats, started: float, values: dict, limit: float) -> list[tuple[int, float]]:
    """``(rank, seconds since its last heartbeat)`` of unfinished ranks quiet for over ``limit``
    (``limit`` + :data:`STARTUP_S` for a rank that has not beaten yet: it is still starting)."""
    now = time.monotonic()
    quiet = []
    for r in range(len(beats)):
        if r in values:
            continue
        last = beats[r] if beats[r] > 0 else started
        if now - last > limit + (0.0 if beats[r] > 0 else STARTUP_S):
            quiet.append((r, now - last))
    return quiet


def _raise_rank_error(msg: tuple, beats=None, started: float = 0.0, values: dict | None = None) -> None:
    _, rank, kind, text, tb = msg
    text = " ".join(text.split())  # one line: torch's messages span several
    text = text.removeprefix(f"rank {rank}: ")  # named below already (errors that name their rank)
    hint = ""
    if beats is not None:
        quiet = [(r, s) for r, s in _quiet_ranks(beats, started, values or {}, QUIET_S) if r != rank]
        if quiet:
            names = ", ".join(f"rank {r} ({s:.0f} s)" for r, s in quiet)
            hint = f"; no heartbeat from {names}: stopped or hung?"
    err = DistributedError(f"rank {rank} failed: {text}{hint}")
    err.remote_traceback = tb  # shown by the CLI with --debug
    raise err


def _collect(procs, results, world_size: int, beats, started: float, silence_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            msg = results.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[0] != "ok":
                _raise_rank_error(msg, beats, started, values)
            values[msg[1]] = pickle.loads(msg[2])
            continue
        dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
        if dead:
            # A rank that exited may still have a message in flight: drain for a moment first.
            try:
                msg = results.get(timeout=2.0)
            except queue.Empty:
                raise DistributedError(
                    f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without reporting; "
                    "the other ranks were stopped"
                ) from None
            if msg[0] != "ok":
                _raise_rank_error(msg, beats, started, values)
            values[msg[1]] = pickle.loads(msg[2])
            continue
        silent = _quiet_ranks(beats, started, values, silence_s)
        if silent:
            names = ", ".join(f"rank {r}" for r, _ in silent)
            raise DistributedError(
                f"{names} sent no heartbeat for {silent[0][1]:.0f} s (the limit is the timeout, {silence_s - SILENCE_MARGIN_S:g} s, "
                f"+ {SILENCE_MARGIN_S:g} s): stopped or hung; all ranks were stopped"
            )
    return [values[r] for r in range(world_size)]
