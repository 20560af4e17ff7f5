"""Run one piece of GPU work in a spawned child process, so that the launching process never makes
a CUDA context.

The launching process (the CLI's) starts GPU ranks; a CUDA context of its own on GPU 0 would cost
rank 0 about 0.5 GB there, and under exclusive-process compute mode rank 0 could not make its own.
So kernel tuning and ``generate``'s one-process rows run here, in a child that has exited before
any rank starts. The child is a one-rank gloo job of :func:`tree_attn.launch.spawn.launch_ranks`,
for its fault handling (the child's error, death or silence is reported, and it dies with its
parent); the work itself chooses its device. Progress lines the work reports reach the caller's
callback as they come: a thread of the caller relays them from a queue.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DistributedError, TreeAttnError
from .env import DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class ChildResult:
    """What the work returned, and the process that did it (never the caller's)."""

    value: Any
    pid: int
    failed: bool = False  # ``value`` is the TreeAttnError the work raised


def _work(env, fn: Callable, args: tuple, messages) -> ChildResult:
    """In the child: ``fn(*args, say)``; a TreeAttnError comes back as a value, to be raised as it was."""
    say = messages.put if messages is not None else (lambda text: None)
    try:
        result = ChildResult(fn(*args, say), os.getpid())
    except TreeAttnError as exc:
        result = ChildResult(exc, os.getpid(), failed=True)
    if messages is not None:  # every line reaches the pipe before the result reaches the parent
        messages.close()
        messages.join_thread()
    return result


def _relay(messages, progress: Callable[[str], None], done: threading.Event) -> None:
    """Hand each line to ``progress`` until the child is done and its lines are drained. The queue
    is drained even if ``progress`` fails, so the child never blocks on a full pipe."""
    while True:
        try:
            text = messages.get(timeout=0.1)
        except queue.Empty:
            if done.is_set():
                return
            continue
        try:
            progress(text)
        except Exception:  # noqa: BLE001 - a progress display that fails must not stall the work
            progress = lambda text: None


def run_in_child(fn: Callable[..., Any], args: tuple = (), *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 progress: Callable[[str], None] | None = None) -> ChildResult:
    """Run ``fn(*args, say)`` in a spawned child process; ``say(text)`` reaches ``progress``.

    ``fn`` is a module-level (picklable) function, ``args`` picklable. A TreeAttnError raised by
    ``fn`` is raised here unchanged; any other failure, or the child's death or silence (no
    heartbeat for ``timeout_s`` + 30 s), is a :class:`DistributedError` naming ``what``.
    """
    import torch.multiprocessing as mp

    from .spawn import launch_ranks

    messages = mp.get_context("spawn").Queue() if progress is not None else None
    done = threading.Event()
    relay = None
    if messages is not None:
        relay = threading.Thread(target=_relay, args=(messages, progress, done), name="tree-attn-child-progress",
                                 daemon=True)
        relay.start()
    try:
        (result,) = launch_ranks(_work, 1, args=(fn, args, messages), backend="gloo", device_kind="cpu",
                                 timeout_s=timeout_s)
    except DistributedError as exc:
        text = str(exc)  # launch_ranks speaks of "rank 0"; here it is the child
        text = text.removeprefix("rank 0 ")
        text = text.replace("; the other ranks were stopped", "")  # there are none
        err = DistributedError(f"{what} (a child process) {text}")
        err.remote_traceback = getattr(exc, "remote_traceback", None)
        raise err from exc
    finally:
        done.set()
        if relay is not None:
            relay.join()
    if result.failed:
        raise result.value
    return result
