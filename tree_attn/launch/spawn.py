"""Spawned rank processes: one per rank (CPU/gloo, or one GPU each).

``spawn_ranks(fn, world_size, ...)`` runs ``fn(env, *args)`` in ``world_size`` fresh
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
- Ctrl-C at a terminal signals the ranks too (the whole foreground group): a rank never answers
  with a traceback of its own. It starts with SIGINT blocked (it may still be importing torch)
  and then takes the signal's default action, a quiet exit; the parent says "interrupted".
"""

from __future__ import annotations

import contextlib
import datetime
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
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, DistributedError, TreeAttnError
from ..validate import is_int
from .env import DEFAULT_TIMEOUT_S, RankEnv, check_cpu_ranks, check_timeout, gpu_count, resolve_backend
from .group import close_process_group, init_process_group

# Spawned ranks import this module before torch (it holds their entry point): without numpy (an
# optional dependency) torch would warn "Failed to initialize NumPy" once per rank. Ranks never
# hand torch numpy arrays. (The CLI sets the same filter for its own process.)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

HEARTBEAT_S = 0.5  # how often a rank beats (and checks that its parent lives)
# Silence the parent tolerates beyond the collective timeout before it gives a rank up.
SILENCE_MARGIN_S = 30.0
# Before its first heartbeat a rank is still starting: spawning and importing torch take seconds,
# more with many ranks on few cores. This much more silence is allowed then.
STARTUP_S = 120.0
# A rank quiet this long when another rank fails is named in the error (likely the cause).
QUIET_S = 3.0


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


@contextlib.contextmanager
def _ranks_start_deaf_to_sigint():
    """Start the ranks with SIGINT blocked (a signal mask is inherited across fork and exec).

    Ctrl-C at a terminal signals every process of the foreground group, the ranks included. The
    parent answers it (one line, exit 130, every rank killed); a rank starting up, still
    importing torch before any code of ours runs, would print a KeyboardInterrupt traceback of
    its own. Blocked, the signal waits for :func:`_quiet_on_sigint`. In the parent a SIGINT that
    comes meanwhile is delivered when the mask is restored (or at once to another thread of the
    parent, whose handler then interrupts the start: the ranks started so far are killed).
    """
    mask = getattr(signal, "pthread_sigmask", None)  # POSIX only
    if mask is None:
        yield
        return
    previous = mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


def _quiet_on_sigint() -> None:
    """In a rank: SIGINT ends it at once, quietly (the default action, not a KeyboardInterrupt
    and its traceback); the parent reports the interruption. Unblocking delivers a SIGINT that
    came while the rank was starting. A compiler the rank runs (the C kernel's build) keeps the
    default action too, so Ctrl-C stops it as well."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
    _quiet_on_sigint()
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
        init_process_group(
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
        except Exception:  # noqa: BLE001, S110 - the result is already queued for the parent; teardown is best effort
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
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(env: RankEnv, *args)`` on ``world_size`` spawned ranks; return results by rank.

    For callers without a resolved launch (tests, benchmarks, calibration): the arguments are
    checked here, then :func:`spawn_ranks` runs the job. The commands resolve a
    :class:`~tree_attn.launch.setup.LaunchSetup` once and start their ranks through
    :func:`tree_attn.launch.job.run_ranks` instead.

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
    if not is_int(world_size) or world_size < 1:
        raise ConfigError(f"world size must be at least 1; got {world_size}")
    check_timeout(timeout_s, "timeout_s")
    backend = resolve_backend(backend, device_kind)
    if device_kind == "cuda":
        n = gpu_count()
        if world_size > n:
            raise ConfigError(f"world size {world_size} needs {world_size} GPUs; this machine has {n}")
    else:
        check_cpu_ranks(world_size, "world size")
    return spawn_ranks(fn, world_size, backend=backend, device_kind=device_kind, timeout_s=timeout_s, args=args)


def spawn_ranks(fn: Callable[..., Any], world_size: int, *, backend: str, device_kind: str, timeout_s: float,
                args: tuple = ()) -> list[Any]:
    """Spawn ``world_size`` ranks running ``fn(env, *args)`` and return their results by rank.

    Trusts its arguments (a resolved launch: a backend that is not ``auto``, a world size that
    fits the machine); :func:`launch_ranks` checks them for callers without one.
    """
    import torch.multiprocessing as mp

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
        with _ranks_start_deaf_to_sigint():
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


# What a rank's error says when a peer went away first (gloo's "Connection closed by peer" from
# pair.cc, NCCL's "remote process exited"): that peer's own error is the cause. Which report
# reaches the launcher first is a race (the failing rank's queue feeder against its sockets
# closing), so on such an error the launcher waits up to PEER_ERROR_GRACE_S for another rank's
# own error and reports that one.
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")
PEER_ERROR_GRACE_S = 2.0


def _peer_gone(msg: tuple) -> bool:
    return msg[0] != "ok" and any(p in msg[3].lower() for p in PEER_GONE)


def _cause(first: tuple, results, grace_s: float = PEER_ERROR_GRACE_S) -> tuple:
    """The error message to report: ``first``, unless it only says that a peer went away and
    another rank's own error arrives within ``grace_s`` (then that one)."""
    if not _peer_gone(first):
        return first
    deadline = time.monotonic() + grace_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = results.get(timeout=left)
        except queue.Empty:
            break
        if msg[0] != "ok" and not _peer_gone(msg):
            return msg
    return first


def _raise_cause(msg: tuple, procs, results, beats, started: float, values: dict) -> None:
    """Raise the error that explains a failed run, ``msg`` being the first error to arrive: a
    peer's own error if one comes (:func:`_cause`); else, if ``msg`` only says a peer went away
    and a rank died without reporting (a nonzero exit code: ``os._exit``, a signal, the OOM
    killer), that death."""
    msg = _cause(msg, results)
    if _peer_gone(msg):
        died = [(r, p.exitcode) for r, p in enumerate(procs)
                if r != msg[1] and r not in values and p.exitcode not in (None, 0)]
        if died:
            rank, code = died[0]
            raise _died(rank, code, f" (rank {msg[1]} lost its connection to it)")
    _raise_rank_error(msg, beats, started, values)


def _died(rank: int, code: int, why: str = "") -> DistributedError:
    return DistributedError(f"rank {rank} died (exit code {code}) without reporting; the other ranks were stopped{why}")


def _raise_rank_error(msg: tuple, beats=None, started: float = 0.0, values: dict | None = None) -> None:
    _, rank, _kind, text, tb = msg
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
                _raise_cause(msg, procs, results, beats, started, values)
            values[msg[1]] = pickle.loads(msg[2])
            continue
        dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
        if dead:
            # A rank that exited may still have a message in flight: drain for a moment first.
            try:
                msg = results.get(timeout=2.0)
            except queue.Empty:
                raise _died(dead[0], procs[dead[0]].exitcode) from None
            if msg[0] != "ok":
                _raise_cause(msg, procs, results, beats, started, values)
            values[msg[1]] = pickle.loads(msg[2])
            continue
        silent = _quiet_ranks(beats, started, values, silence_s)
        if silent:
            names = ", ".join(f"rank {r}" for r, _ in silent)
            raise DistributedError(
                f"{names} sent no heartbeat for {silent[0][1]:.0f} s "
                f"(the limit is the timeout, {silence_s - SILENCE_MARGIN_S:g} s, + {SILENCE_MARGIN_S:g} s): "
                "stopped or hung; all ranks were stopped"
            )
    return [values[r] for r in range(world_size)]
