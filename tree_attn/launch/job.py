"""The rank job runner: run one function on every rank of a resolved launch and gather what each
returns, whether the job spawns its ranks or this process is one rank of a torchrun job; and the
small helpers every job shares (progress from rank 0, percentiles, the name of a rank's device).

``run``, ``generate``, ``tune`` and ``probe --measure`` all start their ranks through
:func:`run_ranks`. The launching process does no device work: the device's name comes from rank 0.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DistributedError
from .env import RankEnv
from .setup import LaunchSetup


@dataclass
class JobResult:
    """What :func:`run_ranks` gathered: each rank's value in rank order, and rank 0's device name
    (taken in rank 0, so the launching process never touches a device)."""

    values: list[Any]
    device: str


def device_name(device: str) -> str:
    """A rank's device as people read it: the GPU's name (``cuda:N``), or the host's processor and
    core count. Call it where the rank runs: asking CUDA in the launching process would make a
    CUDA context there."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def say_on_rank_0(env: RankEnv, text: str) -> None:
    """A progress line on stderr from rank 0 only (every rank runs the same steps)."""
    if env.rank == 0:
        print(f"[rank 0] {text}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by linear interpolation."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _on_rank(env: RankEnv, fn: Callable[..., Any], args: tuple) -> tuple[Any, str | None]:
    """In every rank: ``fn(env, *args)``, with rank 0's device name beside its value."""
    return fn(env, *args), device_name(env.device) if env.rank == 0 else None


def run_ranks(fn: Callable[..., Any], launch: LaunchSetup, args: tuple = ()) -> JobResult | None:
    """Run ``fn(env: RankEnv, *args)`` on every rank of ``launch`` and gather the values.

    Spawned ranks (``launch.torchrun`` None): ``launch.world_size`` fresh processes
    (:func:`tree_attn.launch.spawn.spawn_ranks`); ``fn`` and ``args`` are pickled to them. Under
    torchrun: this process joins the job's group as its rank, runs ``fn`` with ``args`` as they
    are (nothing is pickled), and the values are gathered to rank 0; the group is torn down (after
    a barrier when every rank succeeded) before this returns. Returns the values by rank in the
    launching process or on rank 0, None on the other torchrun ranks.
    """
    if launch.torchrun is None:
        from .spawn import spawn_ranks

        per_rank = spawn_ranks(_on_rank, launch.world_size, backend=launch.backend, device_kind=launch.device_kind,
                               timeout_s=launch.timeout_s, args=(fn, args))
        return JobResult([value for value, _ in per_rank], per_rank[0][1])
    import torch.distributed as dist

    from .group import close_process_group, init_torchrun

    env = launch.torchrun
    init_torchrun(env, launch.timeout_s)
    ok = False
    try:
        mine = _on_rank(env, fn, args)
        gathered: list | None = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        ok = True
    except DistributedError as exc:
        # Every rank of a node prints its error on the node's one stderr: say whose line it is.
        raise DistributedError(f"rank {env.rank} of {env.world_size}: {exc}") from exc
    finally:
        # After success, a barrier first (at most the timeout): no rank tears its group down
        # while a peer still moves the gathered values (a gloo pair destroyed under a peer's
        # pending transfer aborts the process, "terminate called without an active exception";
        # seen with 2 torchrun nodes x 2 ranks on loopback). After a failure, at once.
        close_process_group(clean=ok, timeout_s=launch.timeout_s)
    if gathered is None:
        return None
    return JobResult([value for value, _ in gathered], gathered[0][1])
