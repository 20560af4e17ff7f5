"""The default process group of a rank: joining it (spawned ranks, torchrun), barriers, and a
teardown that never destroys a communicator under a peer's feet. torch is imported inside the
functions.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import warnings

from ..errors import DistributedError, TreeAttnError
from .env import RankEnv, torchrun_rendezvous


def init_process_group(backend: str, device: str, **kwargs) -> None:
    """``init_process_group`` with a GPU rank's device made current and bound (``device_id``).

    Binding the device tells NCCL which GPU this rank drives, so barriers and collectives need
    not guess it (torch warns "Guessing device ID based on global rank" and "barrier(): using the
    device under current context" otherwise), and creates the communicator eagerly. The tree's
    concurrent receives then share that communicator, which is why ``reduce.exchange`` posts a
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
    """``dist.barrier()`` naming this rank's GPU on NCCL (no device guess, no warning); a failure
    (a peer dead or unreachable past the timeout) is a DistributedError, one line."""
    import torch.distributed as dist

    from ..reduce.comm import PEER_HINT, transport_text

    try:
        if env.backend == "nccl" and env.device.startswith("cuda"):
            dist.barrier(device_ids=[int(env.device.split(":")[1])])
        else:
            dist.barrier()
    except RuntimeError as exc:  # a collective of all ranks: the backend does not say which one failed
        raise DistributedError(f"barrier of the {env.world_size} ranks failed: {transport_text(exc)} "
                               f"({PEER_HINT})") from exc


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
            f"no torchrun job answers at {where} (RANK={env.rank} of WORLD_SIZE={env.world_size}) within "
            f"{timeout_s:g} s; {hint}"
        )
    try:
        init_process_group(env.backend, env.device, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    except TreeAttnError:
        raise
    except Exception as exc:  # torch raises DistNetworkError, RuntimeError, ValueError...
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise DistributedError(
            f"could not join the torchrun job at {where} as RANK={env.rank} of WORLD_SIZE={env.world_size} within "
            f"{timeout_s:g} s ({type(exc).__name__}: {first}); {hint}"
        ) from exc

