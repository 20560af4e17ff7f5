"""Launching ranks: spawn one process per rank (CPU/gloo or one GPU each), or join a torchrun job.

``launch_ranks(fn, world_size)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh
processes with torch.distributed initialised (file:// rendezvous in a private temp dir, so no
ports are needed) and returns each rank's result in rank order. If a rank raises or dies, the
others are terminated and a :class:`DistributedError` names the rank and its error: the parent
never hangs waiting for a dead peer.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import DistributedError, TreeAttnError

BACKENDS = ("auto", "gloo", "nccl")


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
    return backend


def torchrun_env(device_kind: str | None = None, backend: str = "auto") -> RankEnv | None:
    """The rank environment set by torchrun (RANK, WORLD_SIZE, LOCAL_RANK), or None.

    ``device_kind`` ("cpu" / "cuda"; None = a GPU when one is visible) and ``backend`` are the
    run's own choices, so ``--device cpu`` under torchrun on a GPU host runs CPU ranks over gloo.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    kind = device_kind if device_kind is not None else ("cuda" if gpu_count() > 0 else "cpu")
    device = f"cuda:{local}" if kind == "cuda" else "cpu"
    return RankEnv(rank=rank, world_size=world, backend=resolve_backend(backend, kind), device=device, local_rank=local)


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


def init_torchrun(env: RankEnv, timeout_s: float) -> None:
    """Initialise the default process group from torchrun's environment (env:// rendezvous)."""
    _init_process_group(env.backend, env.device, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))


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
) -> None:
    import torch
    import torch.distributed as dist

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
    except TreeAttnError as exc:
        results.put(("error", rank, type(exc).__name__, str(exc), traceback.format_exc()))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, type(exc).__name__, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


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
        timeout_s: the collective timeout inside the ranks; the parent gives up at 3x this.

    Raises:
        DistributedError: a rank raised or died; the message names the rank and the cause.
    """
    import torch.multiprocessing as mp

    from ..errors import ConfigError

    if world_size < 1:
        raise ConfigError(f"world size must be at least 1; got {world_size}")
    backend = resolve_backend(backend, device_kind)
    if device_kind == "cuda":
        n = gpu_count()
        if world_size > n:
            raise ConfigError(f"world size {world_size} needs {world_size} GPUs; this machine has {n}")
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tree-attn-rdzv-")
    init_file = os.path.join(tmp, "rendezvous")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, backend, device_kind, init_file, timeout_s, fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, deadline=time.monotonic() + 3 * timeout_s + 60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_rank_error(msg: tuple) -> None:
    _, rank, kind, text, tb = msg
    err = DistributedError(f"rank {rank} failed: {text}")
    err.remote_traceback = tb  # shown by the CLI with --debug
    raise err


def _collect(procs, results, world_size: int, deadline: float) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            msg = results.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[0] != "ok":
                _raise_rank_error(msg)
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
                _raise_rank_error(msg)
            values[msg[1]] = pickle.loads(msg[2])
            continue
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(values))
            raise DistributedError(f"ranks {missing} did not finish in time; they were stopped")
    return [values[r] for r in range(world_size)]
