"""Functions run inside spawned ranks (module level so the spawn start method can pickle them)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tests.dist.cases import PlanCase
from tree_attn import ReductionPlan, ring_decode, tree_decode


@dataclass(frozen=True)
class Case(PlanCase):
    """One distributed decode case. ``shard_lens[r]`` tokens on rank r; ``valid[r]`` optional
    per-row valid lengths of that shard (seq_lens)."""

    name: str
    strategy: str  # "allreduce" | "tree" | "ring"
    shard_lens: tuple[int, ...]
    batch: int = 2
    valid: tuple[tuple[int, ...], ...] | None = None
    q_scale: float = 1.0

    def inputs(self):
        """q and every shard's (k, v, seq_lens), identical in every process."""
        g = torch.Generator().manual_seed(self.seed)
        q = (torch.randn(self.batch, self.q_heads, self.head_dim, generator=g) * self.q_scale).to(self.dtype)
        shards = []
        for r, n in enumerate(self.shard_lens):
            k = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            v = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            sl = torch.tensor(self.valid[r]) if self.valid is not None else None
            shards.append((k, v, sl))
        return q, shards


def run_cases(env, cases: list[Case]):
    results = []
    for case in cases:
        q, shards = case.inputs()
        k, v, sl = shards[env.rank]
        if case.strategy == "ring":
            out, lse = ring_decode(q, k, v, seq_lens=sl)
        else:
            plan = ReductionPlan(case.strategy, case.fanout, rank_order=case.rank_order)
            out, lse = tree_decode(q, k, v, seq_lens=sl, plan=plan)
        results.append((out, lse))
    return results


def mismatched_query(env):
    heads = 8 if env.rank != 1 else 4
    q = torch.randn(1, heads, 16)
    k = torch.randn(1, 3, 2, 16)
    return tree_decode(q, k, k)


def raises_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("boom on purpose")
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 3, 2, 8)
    return tree_decode(q, k, k)


def fails_after_its_sockets_close(env, delay_s: float):
    """Rank 1 closes its process group (its peers' waits end in "Connection closed by peer"),
    then reports its own error ``delay_s`` later: the knock-on reaches the launcher first."""
    import torch.distributed as dist

    if env.rank == 1:
        dist.destroy_process_group()
        time.sleep(delay_s)
        raise ValueError("rank 1's own failure, reported after its sockets closed")
    dist.recv(torch.zeros(4), src=1)  # never sent: ends when rank 1's sockets close


def dies_on_rank_2(env):
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 3, 2, 8)
    tree_decode(q, k, k)  # everyone is up
    if env.rank == 2:
        os._exit(3)
    time.sleep(0.5)
    return tree_decode(q, k, k, plan=ReductionPlan("allreduce"))


def ring_lengths_and_dtype_checks(env):
    """World 3. Returns (ring result without lengths, ring result with lengths, the error text for
    wrong lengths, the error text when rank 1's KV dtype differs)."""
    from tree_attn import DistributedError

    lens = (5, 0, 7)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 16, generator=g)
    shards = [torch.randn(2, n, 2, 16, generator=g) for n in lens]
    k = shards[env.rank]
    v = k.flip(-1).contiguous()
    plain = ring_decode(q, k, v)
    given = ring_decode(q, k, v, lengths=list(lens))
    try:
        ring_decode(q, k, v, lengths=[1, 2, 3])
        wrong = None
    except DistributedError as exc:
        wrong = str(exc)
    kd = k.to(torch.bfloat16) if env.rank == 1 else k
    try:
        tree_decode(q, kd, kd)
        dtype_err = None
    except DistributedError as exc:
        dtype_err = str(exc)
    return plain, given, wrong, dtype_err


def shard_inputs(seed: int, world: int, lens, batch=2, q_heads=8, kv_heads=2, head_dim=16, dtype=torch.float32):
    """q and every rank's shard from one seed (identical in every process)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    shards = [(torch.randn(batch, n, kv_heads, head_dim, generator=g).to(dtype),
               torch.randn(batch, n, kv_heads, head_dim, generator=g).to(dtype)) for n in lens]
    return q, shards


def static_step_loop(env, strategy: str, capacity: int, steps: int, seed: int):
    """A decode loop on static buffers (TreeDecodeStep): every rank holds a cache of ``capacity``
    tokens; each step writes a new query into q in place and grows one rank's valid length (the
    rank the new token lands on: step % world), as a serving engine does. Returns, per step, the
    query, every rank's valid lengths, and this rank's (out, lse) copies, plus the traffic."""
    from tree_attn.reduce.collectives import TreeDecodeStep
    from tree_attn.reduce.comm import CommStats

    world = env.world_size
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, capacity, 2, 16, generator=g)
    v = torch.randn(2, capacity, 2, 16, generator=g)
    # Another rank's cache differs: draw every rank's in order, keep ours.
    for r in range(world):
        kr = torch.randn(2, capacity, 2, 16, generator=g)
        vr = torch.randn(2, capacity, 2, 16, generator=g)
        if r == env.rank:
            k, v = kr, vr
    dev = torch.device(env.device)  # CPU ranks, or this rank's GPU (then the step is a CUDA graph)
    k, v = k.to(dev), v.to(dev)
    lens = torch.tensor([[capacity // 3, 0]] * world)  # [rank, row]; row 1 starts empty everywhere
    q = torch.zeros(2, 8, 16, device=dev)
    seq_lens = lens[env.rank].clone().to(dev)
    plan = ReductionPlan(strategy, 2)
    stats = CommStats()
    history = []
    # Closed on the way out, error or not: a graph alive at the group's teardown would hang NCCL's.
    with TreeDecodeStep(q, k, v, seq_lens, plan=plan) as step:
        captured = step.captured
        for s in range(steps):
            q.copy_(torch.randn(2, 8, 16, generator=g))
            owner = s % world
            lens[owner] = torch.clamp(lens[owner] + torch.tensor([1, 2]), max=capacity)
            seq_lens.copy_(lens[env.rank])
            out, lse = step(stats)
            step.wait(f"static step {s}")  # bounded by the group's timeout (a no-op on CPU ranks)
            history.append(tuple(t.to("cpu", copy=True) for t in (q, lens, out, lse)))
        traffic = (step.traffic.messages, step.traffic.bytes_sent)
    assert step.graph.closed and step.graph.graph is None
    return history, (stats.messages, stats.bytes_sent), traffic, captured


def gpu_static_loops(env, capacity: int, steps: int):
    """static_step_loop for both merge strategies on GPU ranks (one launch)."""
    return {s: static_step_loop(env, s, capacity, steps, 40 + env.world_size) for s in ("tree", "allreduce")}


def growing_shard_on_one_rank(env, steps: int):
    """The public tree_decode in a loop where only the last rank's shard grows (by one token a
    step): its local kernel is prepared anew each step while the others' are cached, and no rank
    may wait for a shape exchange the others skip. Returns every step's (out, lse)."""
    world = env.world_size
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(1, 4 + r, 2, 16, generator=g) for r in range(world)]
    extra = torch.randn(1, steps, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    results = []
    for s in range(steps):
        k = base[env.rank]
        if env.rank == world - 1:
            k = torch.cat([k, extra[:, : s + 1]], dim=1)
        results.append(tree_decode(q, k, k.flip(-1)))
    return results


def repeated_identical_calls(env, strategy: str, calls: int, seed: int):
    """The same inputs ``calls`` times (random shard sizes, some empty): the results of every call
    must be bitwise those of the first (buffers reused across isend/irecv must not race)."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(0, 9, (env.world_size,), generator=g)]
    q, shards = shard_inputs(seed, env.world_size, lens)
    k, v = shards[env.rank]
    outs = []
    for _ in range(calls):
        if strategy == "ring":
            outs.append(ring_decode(q, k, v))
        else:
            outs.append(tree_decode(q, k, v, plan=ReductionPlan(strategy, 2)))
    return lens, outs


def nan_inputs(env):
    """NaN in the data on one rank must reach every rank's result as NaN in that row only.
    Cases: (name, strategy, which rank poisons, what). Returns {name: (out, lse)}."""
    world = env.world_size
    results = {}
    for strategy in ("tree", "allreduce", "ring"):
        for what in ("key", "value", "query"):
            lens = [3 + r for r in range(world)]
            q, shards = shard_inputs(17, world, lens)
            k, v = (t.clone() for t in shards[env.rank])
            bad_rank = min(2, world - 1)
            if what == "query":
                q = q.clone()
                q[1, 3, 0] = float("nan")  # row 1, head 3 only
            elif env.rank == bad_rank:
                t = k if what == "key" else v
                t[1, 1, 0, 0] = float("nan")  # row 1, one key of KV head 0 (query heads 0..3)
            if strategy == "ring":
                results[(strategy, what)] = ring_decode(q, k, v)
            else:
                results[(strategy, what)] = tree_decode(q, k, v, plan=ReductionPlan(strategy, 2))
    return results


def prepared_checks(env, capacity: int, steps: int, calls: int):
    """Every check of tests/dist/test_prepared_steps.py in one launch (spawning ranks is the slow
    part on 2 cores). Returns a dict of each check's results on this rank."""
    results = {}
    for strategy in ("tree", "allreduce"):
        results[("static", strategy)] = static_step_loop(env, strategy, capacity, steps, 40 + env.world_size)
    results["growing"] = growing_shard_on_one_rank(env, steps)
    for strategy in ("tree", "allreduce", "ring"):
        results[("repeat", strategy)] = repeated_identical_calls(env, strategy, calls, 7 + env.world_size)
    results["nan"] = nan_inputs(env)
    return results


# -- faults (tests/dist/test_faults.py) ------------------------------------------------------------


def big_result(env, nbytes: int) -> bytes:
    """A result far larger than a pipe's buffer: the parent must drain the queue as it comes."""
    return bytes([env.rank]) * nbytes


def sleeps(env, seconds: float) -> int:
    """Busy longer than the parent's old total deadline would have allowed (heartbeats go on)."""
    time.sleep(seconds)
    return env.rank


def stops_itself(env) -> None:
    """SIGSTOP: no heartbeat, no exit; the parent must give up after its silence limit."""
    import signal

    os.kill(os.getpid(), signal.SIGSTOP)


def own_tcp_addresses(env) -> tuple[str | None, list[str]]:
    """``(GLOO_SOCKET_IFNAME, local IPv4/IPv6 addresses of this process's TCP sockets)`` after a
    collective, so that gloo's listening and connected sockets exist (Linux /proc only)."""
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[9] in inodes:
                addresses.append(cols[1].split(":")[0])  # hex, in the kernel's byte order
    return os.environ.get("GLOO_SOCKET_IFNAME"), addresses


# -- step lifetime and teardown (tests/dist/test_teardown.py) --------------------------------------


def _wait_for_file(path: str, limit_s: float) -> bool:
    """Whether ``path`` exists within ``limit_s`` seconds (polled)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)


def lifetime_and_teardown(env, second_init: str, entered: str, flag: str, delay_s: float):
    """World 2, CPU ranks (gloo). Returns this rank's findings:

    1. a TreeDecodeStep's waits take the group's timeout, and the step (with its CapturedStep)
       is freed the moment its last reference goes, with the garbage collector off;
    2. ``close_process_group`` after success waits for the peer at a barrier: rank 0 writes
       ``entered`` as it enters its close, rank 1 comes ``delay_s`` after seeing it, so rank 0's
       close must return after rank 1 arrived (``time.monotonic`` is one clock for every process
       of the host). Ordered by the file, not by when each rank left the step: nothing bounds
       that gap (rank 0 sends the step's last message and may be descheduled after it for
       longer than any margin on a loaded machine);
    3. in a second group rank 1 never reaches teardown: rank 0's close gives up after its 1 s
       timeout, aborts the group with a warning, and returns (rank 1 waits for ``flag``, written
       by rank 0 once its close returned, so that a close that never returns fails the test).
    """
    import datetime
    import gc
    import warnings
    import weakref

    import torch.distributed as dist

    from tree_attn.launch.group import close_process_group, init_process_group
    from tree_attn.reduce.collectives import TreeDecodeStep

    found = {}
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 3 + env.rank, 2, 8)
    step = TreeDecodeStep(q, k, k, plan=ReductionPlan("tree", 2))
    found["step_timeout_s"] = step.graph.timeout_s
    out, _ = step()
    found["finite"] = bool(torch.isfinite(out).all())
    refs = (weakref.ref(step), weakref.ref(step.graph))
    gc.disable()
    try:
        del step
        found["freed"] = [r() is None for r in refs]
    finally:
        gc.enable()

    if env.rank == 0:
        with open(entered, "w"):
            pass
        t0 = time.monotonic()
        close_process_group(clean=True, timeout_s=60.0)
        found["first_returned_at"] = time.monotonic()
        found["barrier_waited_s"] = found["first_returned_at"] - t0
    else:
        found["saw_entered"] = _wait_for_file(entered, 90)
        time.sleep(delay_s)
        found["first_arrived_at"] = time.monotonic()
        close_process_group(clean=True, timeout_s=60.0)
    found["first_closed"] = not dist.is_initialized()

    init_process_group("gloo", "cpu", init_method=f"file://{second_init}", rank=env.rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
    if env.rank == 0:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            close_process_group(clean=True, timeout_s=1.0)
        found["gave_up_after_s"] = time.monotonic() - t0
        found["second_closed"] = not dist.is_initialized()
        found["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        with open(flag, "w"):
            pass
    else:
        found["saw_flag"] = _wait_for_file(flag, 90)
    return found


def replay_without_peer(env, flag: str, timeout_s: float):
    """World 2, GPU ranks (NCCL): both ranks capture a tree step; only rank 0 replays it, so its
    replayed receive waits for a send that never comes. Its ``wait()`` must give up after
    ``timeout_s``, abort the group and name the rank and the step. Rank 1 stays alive and out of
    every collective until rank 0 has written ``flag`` (a stalled peer, not a dead one).
    Returns ``(captured, the error's text or None, whether the group is still initialised)``
    on rank 0, ``(captured, None, whether it saw the flag)`` on rank 1."""
    import torch.distributed as dist

    from tree_attn.errors import DistributedError
    from tree_attn.reduce.collectives import TreeDecodeStep

    dev = torch.device(env.device)
    q = torch.randn(1, 4, 16, device=dev)
    k = torch.randn(1, 8, 2, 16, device=dev)
    step = TreeDecodeStep(q, k, k, plan=ReductionPlan("tree", 2), timeout_s=timeout_s)
    captured = step.captured
    if env.rank == 0:
        step()
        try:
            step.wait("the replay without its peer")
            error = None
        except DistributedError as exc:
            error = str(exc)
        initialized = dist.is_initialized()
        step.close()
        with open(flag, "w"):
            pass
        return captured, error, initialized
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    step.close()
    return captured, None, os.path.exists(flag)


REFUSAL_LENS = (3, 0, 5)  # rank r's shard length in refusals_and_modes (world 3, an empty shard)


def refusal_inputs():
    """q [2, 8, 16] and every rank's (k, v) shard for :func:`refusals_and_modes`, identical in every
    process."""
    g = torch.Generator().manual_seed(23)
    q = torch.randn(2, 8, 16, generator=g)
    return q, [(torch.randn(2, n, 2, 16, generator=g), torch.randn(2, n, 2, 16, generator=g)) for n in REFUSAL_LENS]


def refusals_and_modes(env):
    """World 3. First calls of three signatures where rank 1 alone passes inputs its own checks
    refuse (tree_decode: a float64 q; TreeDecodeStep: an fp8 shard without k_scale; ring_decode:
    seq_lens beyond its shard), each recorded as (error class, message) per rank: every rank must
    raise, at once, not wait for rank 1 until the collective timeout. Then results to check against
    float64: tree_decode with a q that requires grad, and a new signature first met inside
    torch.inference_mode (tree_decode and a TreeDecodeStep built there), then called outside."""
    from tree_attn import TreeDecodeStep, quantize_kv

    q, shards = refusal_inputs()
    k, v = shards[env.rank]
    bad = env.rank == 1
    k8, v8, ks, vs = quantize_kv(k, v)
    calls = {
        "tree_decode": lambda: tree_decode(q.double() if bad else q, k, v),
        "TreeDecodeStep": lambda: TreeDecodeStep(q, k8, v8, k_scale=None if bad else ks, v_scale=vs)(),
        "ring_decode": lambda: ring_decode(q, k, v, seq_lens=torch.tensor([k.shape[1] + 1 if bad else 0, 0])),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            errors[name] = (type(exc).__name__, str(exc))
    results = {"grad": tree_decode(q.clone().requires_grad_(), k, v)}
    q4 = q[:, :4].contiguous()  # a signature no call above used
    with torch.inference_mode():
        tree_decode(q4, k, v)
        step = TreeDecodeStep(q4, k, v)
    results["after inference mode"] = tree_decode(q4, k, v)
    results["step built in inference mode"] = tuple(t.clone() for t in step())
    step.close()
    return errors, results
