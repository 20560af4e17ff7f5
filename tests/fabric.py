"""A fabric of "nodes" on one Linux machine: network namespaces joined by shaped links, and
torchrun jobs across them. For tests (tests/dist/test_fabric.py) and benchmarks
(benchmarks/bench_fabric.py); needs root (``ip netns``, ``tc``).

Layout of an N-node fabric (names unique per fabric: ``<prefix>-<owner pid>-<random>-...``)::

    namespace ...-n0: lo, fab0 10.88.0.1/24 --veth-- p0 \
    namespace ...-n1: lo, fab0 10.88.0.2/24 --veth-- p1 --- br0 (namespace ...-sw, the switch)
    ...                                              pN-1 /

- A node's own ranks talk over its loopback (gloo binds ``fab0``, but a rank reaches a peer of its
  own node through the kernel's local route: the packets never leave the namespace, so they are
  neither shaped nor counted on ``fab0``).
- Every inter-node packet leaves its node through ``fab0`` (egress ``tbf`` at the rate) and enters
  the destination node through the switch port ``p<dst>`` (egress ``tbf`` at the rate): both
  directions of each node's link are shaped. No ``netem`` here, so there is no added delay, only
  the rate (and the stack's own latency).
- Nothing is created in the machine's own network namespace: two fabrics (two test runs) can
  exist at once, and the same addresses in each never meet.

Teardown always happens: the context manager's exit, ``atexit``, SIGTERM/SIGHUP (turned into a
teardown and then the signal's previous behaviour) and, for an owner killed with SIGKILL, the
stale sweep every new fabric runs first (namespaces of this prefix whose owner pid is dead).
Teardown SIGKILLs every process in every namespace of the fabric (``ip netns pids``: torchrun
starts its ranks in sessions of their own, so a process group kill would miss them), then deletes
the namespaces (which deletes their veths and qdiscs).
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

PREFIX = "tafab"
SUBNET = "10.88.0"  # node i is SUBNET.(i + 1)/24; private to the fabric's namespaces
NODE_IF = "fab0"  # a node's end of its link
TORCHRUN_PORT = 29400
REPO_ROOT = Path(__file__).resolve().parent.parent
# Environment a torchrun job must not inherit from the caller (it would join the wrong job).
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME")

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class FabricError(RuntimeError):
    """A fabric could not be built or driven (the failing command and its stderr)."""


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate: ``"100mbit"`` -> 1e8 (units bit, kbit, mbit, gbit; SI)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", str(rate).lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate {rate!r}: give a number and one of {', '.join(_RATE_UNITS)} (e.g. 100mbit)")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


# A bucket of two full frames: each message leaves at the link's rate, as from a NIC (with tbf's
# default-sized bucket a 16.5 KB decode message leaves an idle link at the veth's own speed, so
# the rate bounds throughput but not each message's time). Good up to a few hundred Mbit/s: at
# 1 Gbit/s and above the kernel's timers cannot refill so small a bucket fast enough (measured:
# 220-280 Mbit/s through a "1gbit" tbf with this bucket; :func:`nic_burst_bytes` scales it).
NIC_BURST_BYTES = 3000


def nic_burst_bytes(rate_bps: float) -> int:
    """A NIC-like bucket for ``rate_bps``: about 100 us of the rate, at least two full frames
    (:data:`NIC_BURST_BYTES`). A decode message leaves at the link's rate (to within 100 us), and
    the bucket still refills at gigabit rates (measured here with a TCP transfer between two
    nodes: 807 Mbit/s through a "1gbit" tbf with it, against 280 Mbit/s with a 3,000 B bucket)."""
    return max(NIC_BURST_BYTES, int(rate_bps / 8 * 100e-6))


def tbf_burst_bytes(rate_bps: float) -> int:
    """The tbf bucket: 5 ms of the rate, at least 64 KiB (a GSO super-packet of up to 64 KiB
    leaving a veth is segmented by tbf if larger than the bucket, but a bucket below a few ms of
    the rate caps the rate itself at high rates: the kernel refills it per timer tick)."""
    return max(64 * 1024, int(rate_bps / 8 * 0.005))


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise FabricError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tc(ns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20,
                          check=False)
    if proc.returncode != 0:
        raise FabricError(f"tc {' '.join(args)} (in {ns}): {proc.stderr.strip() or proc.returncode}")


def _sysctl_ipv6_off(ns: str) -> None:
    for key in ("all", "default"):
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                       capture_output=True, timeout=20, check=False)


def list_namespaces() -> list[str]:
    """Names of the machine's network namespaces (``ip netns list``; ids after a name dropped)."""
    proc = _ip("netns", "list", check=False)
    return [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]


def namespace_pids(ns: str) -> list[int]:
    """PIDs of the processes living in namespace ``ns`` (``ip netns pids``)."""
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _cmdline(pid: int) -> str | None:
    """The command line of a live process, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str, deadline_s: float = 10.0) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (a process forking while it is killed
    leaves a child: look again). Returns the PIDs killed."""
    killed: list[int] = []
    end = time.monotonic() + deadline_s
    while True:
        pids = [p for p in namespace_pids(ns) if p != os.getpid()]
        if not pids or time.monotonic() > end:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _delete_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose owner pid is dead (a fabric whose owner was
    killed with SIGKILL), with every process still in them. Returns the names removed."""
    removed = []
    pat = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-")
    for ns in list_namespaces():
        m = pat.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


_AVAILABLE: str | None | bool = False  # False: not checked yet; None: usable; str: why not


def unavailable_reason() -> str | None:
    """None when this process can build a fabric, else why not. Checked by doing it: a namespace
    created and deleted (root, ``ip``, kernel support and a writable /run/netns all needed), and
    ``tc`` with the ``tbf`` qdisc on a veth inside it. Cached."""
    global _AVAILABLE
    if _AVAILABLE is not False:
        return _AVAILABLE  # type: ignore[return-value]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "needs root and network namespaces (Linux only)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "needs root and network namespaces (iproute2's ip and tc not found)"
    else:
        ns = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
        try:
            _ip("netns", "add", ns)
            try:
                _ip("-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "a1")
                _ip("-n", ns, "link", "set", "a0", "up")
                _tc(ns, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1mbit", "burst", "64kb", "latency", "50ms")
            finally:
                _ip("netns", "del", ns, check=False)
        except (FabricError, OSError, subprocess.TimeoutExpired) as exc:
            reason = f"needs root and network namespaces ({str(exc).splitlines()[0][:160]})"
    _AVAILABLE = reason
    return reason


# Every fabric not yet torn down, for atexit and the signal handlers.
_LIVE: set[Fabric] = set()
_LIVE_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _close_all() -> None:
    with _LIVE_LOCK:
        fabrics = list(_LIVE)
    for fab in fabrics:
        fab.close()


def _on_signal(signum, frame, previous) -> None:
    _close_all()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # the default action (terminate): restore it and deliver the signal again
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit and the sweep remain
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        signal.signal(sig, lambda s, f, prev=previous: _on_signal(s, f, prev))


@dataclass(frozen=True)
class Node:
    """One node: its namespace, its address on the fabric, its switch port (in the switch
    namespace) and its own end of the link (``fab0``, in its namespace)."""

    index: int
    ns: str
    addr: str
    port: str
    ifname: str = NODE_IF


@dataclass(frozen=True)
class LinkCounters:
    """A node's ``fab0`` counters (``/sys/class/net/fab0/statistics``): what left and entered the
    node over its link, L2 frames counted whole (Ethernet + IP + TCP headers included)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                            self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


@dataclass
class NodeResult:
    """How one node's torchrun ended: exit code (None: still running when killed at the job's
    deadline), its stdout / stderr and its wall time from start."""

    node: int
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    killed: bool = False

    def error_lines(self) -> list[str]:
        """The CLI's one-line errors ("error: ...") in this node's stderr, one per failed rank
        that reached the CLI (torchrun prefixes nothing: the ranks share its stderr)."""
        return [ln.strip() for ln in self.stderr.splitlines() if ln.lstrip().startswith("error:")]


@dataclass
class TorchrunJob:
    """Torchrun processes started by :meth:`Fabric.torchrun`, one per started node."""

    fabric: Fabric
    procs: dict[int, subprocess.Popen]
    logs: dict[int, tuple[Path, Path]]
    started: float
    ended: dict[int, float] = field(default_factory=dict)

    def poll(self) -> bool:
        """Whether every node's torchrun has exited (recording when each did)."""
        for n, p in self.procs.items():
            if n not in self.ended and p.poll() is not None:
                self.ended[n] = time.monotonic()
        return len(self.ended) == len(self.procs)

    def stderr_now(self, node: int) -> str:
        """What node ``node``'s torchrun (and its ranks) wrote on stderr so far."""
        return self.logs[node][1].read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> int | None:
        """Wait until ``text`` appears on some node's stderr; returns that node, or None when
        ``timeout`` s pass or every torchrun exits first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for n in self.procs:
                if text in self.stderr_now(n):
                    return n
            if self.poll():
                return None
            time.sleep(0.02)
        return None

    def wait(self, timeout: float) -> list[NodeResult]:
        """Wait up to ``timeout`` s for every node's torchrun; one still running then is killed
        (with everything in its namespace) and reported with ``killed=True``. Results by node."""
        end = time.monotonic() + timeout
        while not self.poll() and time.monotonic() < end:
            time.sleep(0.05)
        killed = [n for n in self.procs if n not in self.ended]
        for n in killed:
            self.fabric.kill_node(n)
            self.procs[n].wait(timeout=10)
            self.ended[n] = time.monotonic()
        results = []
        for n, p in sorted(self.procs.items()):
            out_path, err_path = self.logs[n]
            results.append(NodeResult(n, None if n in killed else p.returncode, out_path.read_text(errors="replace"),
                                      err_path.read_text(errors="replace"), self.ended[n] - self.started,
                                      killed=n in killed))
        return results


def run_report(results: list[NodeResult]) -> dict:
    """The ``tree-attn run --json`` report of a job: the stdout of the node holding rank 0 (c10d
    numbers nodes by arrival, so it is not always node 0; the others print nothing)."""
    import json

    reports = [r.stdout for r in results if r.stdout.strip()]
    if len(reports) != 1:
        raise FabricError(f"expected one node to report, got {len(reports)}: "
                          + " | ".join(r.stderr[-2000:] for r in results))
    return json.loads(reports[0])


class Fabric:
    """N nodes as network namespaces on one switch, each link shaped by ``tbf`` to ``rate``.

    Usage::

        with Fabric(2, rate="100mbit") as fab:
            job = fab.torchrun(["run", "--device", "cpu", "-n", "16384", "--json"], ranks_per_node=2)
            results = job.wait(timeout=120)

    Methods change a node's link while a job runs (:meth:`set_rate`, :meth:`link_down`,
    :meth:`link_up`), read its counters (:meth:`counters`) and run commands in a node
    (:meth:`exec`). :meth:`close` (idempotent) kills every process in the fabric's namespaces and
    deletes them.
    """

    def __init__(self, nodes: int, rate: str | None = "100mbit", *, prefix: str = PREFIX,
                 burst_bytes: int | str | None = None, rates: dict[int, str | None] | None = None) -> None:
        if not isinstance(nodes, int) or nodes < 1 or nodes > 200:
            raise ValueError(f"nodes must be an integer in 1..200; got {nodes!r}")
        self.rate = rate
        # tbf bucket: None = :func:`tbf_burst_bytes` of the rate. A bucket larger than a message
        # lets that message leave at the veth's own speed when the link was idle (the rate then
        # bounds throughput, not each message's time); a bucket of about one frame (~2 KB)
        # serialises every message at the rate, as a NIC does, but at gigabit rates and above
        # the kernel's timers cannot refill so small a bucket fast enough. ``"nic"``:
        # :func:`nic_burst_bytes` of each rate.
        if isinstance(burst_bytes, str) and burst_bytes != "nic":
            raise ValueError(f"burst_bytes: a number of bytes, 'nic' or None; got {burst_bytes!r}")
        self.burst_bytes = burst_bytes
        if rate is not None:
            parse_rate(rate)
        self.prefix = prefix
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.nodes = [Node(i, f"{self.tag}-n{i}", f"{SUBNET}.{i + 1}", f"p{i}") for i in range(nodes)]
        # Per node (its link to the switch, both ways): ``rates`` overrides ``rate`` for some
        # nodes, e.g. two nodes at 1gbit and the rest at 100mbit: the pair of fast nodes talk at
        # 1 Gbit/s, every pair with a slow node at the slow node's rate.
        self.rates: dict[int, str | None] = {i: (rates or {}).get(i, rate) for i in range(nodes)}
        for r in self.rates.values():
            if r is not None:
                parse_rate(r)
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._tmp: str | None = None
        self._closed = False
        self._jobs = 0

    # -- building and tearing down ------------------------------------------------------------

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> Fabric:
        reason = unavailable_reason()
        if reason is not None:
            raise FabricError(reason)
        sweep_stale(self.prefix)
        _install_handlers()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._tmp = tempfile.mkdtemp(prefix=f"{self.tag}-")
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _sysctl_ipv6_off(self.switch)
            for node in self.nodes:
                self._add_ns(node.ns)
                _ip("-n", self.switch, "link", "add", node.port, "type", "veth", "peer", "name", node.ifname,
                    "netns", node.ns)
                _ip("-n", self.switch, "link", "set", node.port, "master", "br0")
                _ip("-n", self.switch, "link", "set", node.port, "up")
                _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
                _ip("-n", node.ns, "link", "set", "lo", "up")
                # No IPv6 on the fabric: its router solicitations and multicast reports would
                # cross the links too and blur the counters.
                _sysctl_ipv6_off(node.ns)
                _ip("-n", node.ns, "link", "set", node.ifname, "up")
                if self.rates[node.index] is not None:
                    self._shape(node, self.rates[node.index], "add")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Kill every process in the fabric's namespaces and delete them (and their links)."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:  # torchrun itself first, so it does not restart what is killed next
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in reversed(self._made):
            _delete_namespace(ns)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def namespaces(self) -> list[str]:
        """The fabric's namespaces (the switch's and the nodes'), those that exist now."""
        existing = set(list_namespaces())
        return [ns for ns in [self.switch] + [n.ns for n in self.nodes] if ns in existing]

    def processes(self) -> dict[str, list[int]]:
        """PIDs living in each of the fabric's namespaces."""
        return {ns: namespace_pids(ns) for ns in [self.switch] + [n.ns for n in self.nodes]}

    def rank_processes(self) -> list[tuple[int, int, str]]:
        """``(node, pid, command line)`` of every process in the nodes that is not a torchrun
        agent: the ranks (and anything they started)."""
        found = []
        for node in self.nodes:
            for pid in namespace_pids(node.ns):
                cmd = _cmdline(pid)
                if cmd is not None and "torch.distributed.run" not in cmd:
                    found.append((node.index, pid, cmd))
        return found

    # -- the links -----------------------------------------------------------------------------

    def _shape(self, node: Node, rate: str, verb: str) -> None:
        bps = parse_rate(rate)
        if self.burst_bytes == "nic":
            burst = str(nic_burst_bytes(bps))
        else:
            burst = str(self.burst_bytes or tbf_burst_bytes(bps))
        # Both directions: out of the node (its fab0) and into it (the switch's port toward it).
        _tc(node.ns, "qdisc", verb, "dev", node.ifname, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        _tc(self.switch, "qdisc", verb, "dev", node.port, "root", "tbf", "rate", rate, "burst", burst, "latency",
            "50ms")

    def set_rate(self, node: int, rate: str | None) -> None:
        """Shape node ``node``'s link (both directions) to ``rate`` now; None removes the shaping.
        Safe while traffic flows (``tc qdisc replace``)."""
        n = self.nodes[node]
        if rate is None:
            _tc(n.ns, "qdisc", "del", "dev", n.ifname, "root")
            _tc(self.switch, "qdisc", "del", "dev", n.port, "root")
        else:
            self._shape(n, rate, "replace")
        self.rates[node] = rate

    def link_down(self, node: int) -> None:
        """Cut node ``node``'s cable: its switch port goes down (the node's fab0 loses carrier);
        packets between it and the other nodes are dropped, with no reset sent either way."""
        _ip("-n", self.switch, "link", "set", self.nodes[node].port, "down")

    def link_up(self, node: int) -> None:
        _ip("-n", self.switch, "link", "set", self.nodes[node].port, "up")

    def counters(self, node: int) -> LinkCounters:
        """Node ``node``'s link counters now, read from ``/sys/class/net/fab0/statistics`` inside
        its namespace (``ip netns exec`` mounts that namespace's sysfs)."""
        n = self.nodes[node]
        names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        script = "; ".join(f"cat /sys/class/net/{n.ifname}/statistics/{k}" for k in names)
        proc = subprocess.run(["ip", "netns", "exec", n.ns, "sh", "-c", script], capture_output=True, text=True,
                              timeout=20, check=False)
        if proc.returncode != 0:
            raise FabricError(f"reading {n.ifname} counters in {n.ns}: {proc.stderr.strip()}")
        return LinkCounters(*(int(x) for x in proc.stdout.split()))

    # -- running things in nodes -----------------------------------------------------------------

    def exec(self, node: int, argv: list[str], *, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``node``'s namespace to completion (``subprocess.run`` arguments)."""
        return subprocess.run(["ip", "netns", "exec", self.nodes[node].ns, *argv], check=check, **kwargs)

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``'s namespace, in a session of its own; killed at close."""
        if self._closed:
            raise FabricError("the fabric is closed")
        p = subprocess.Popen(["ip", "netns", "exec", self.nodes[node].ns, *argv], start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def wait_ranks_gone(self, timeout: float) -> float | None:
        """Seconds until no rank process (:meth:`rank_processes`) is left in the nodes, or None
        if some are still there after ``timeout`` s."""
        start = time.monotonic()
        while True:
            if not self.rank_processes():
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                return None
            time.sleep(0.1)

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL every process in node ``node``'s namespace (its torchrun and ranks)."""
        return _kill_namespace(self.nodes[node].ns)

    def torchrun(self, args: list[str], ranks_per_node: int, *, nodes: list[int] | None = None,
                 join_timeout_s: float = 60, env: dict[str, str] | None = None, module: str = "tree_attn",
                 host: int = 0, workers: dict[int, list[str]] | None = None) -> TorchrunJob:
        """Start one torchrun per node (``nodes``: which of them start, default all; a node left
        out never joins) running ``python -m <module> <args>`` on ``ranks_per_node`` ranks each.

        c10d rendezvous on node ``host``'s address (that node hosts the store: ``is_host=1``,
        the others ``is_host=0``, since in a namespace the hostname does not resolve to the
        node's address); ``--local-addr`` the node's own address (otherwise torchrun hands
        ``MASTER_ADDR=localhost`` to the other nodes' ranks); ``GLOO_SOCKET_IFNAME=fab0`` so
        gloo binds the fabric, not loopback; ``join_timeout_s`` bounds the wait for nodes that
        never come; no restarts. PYTHONPATH starts with this repository, so the ranks run this
        checkout's code. ``workers`` replaces what torchrun starts on given nodes (the argv after
        torchrun's own options, e.g. ``["--no-python", "sleep", "600"]``: ranks that never join).
        Each node's stdout / stderr go to files, read by :meth:`TorchrunJob.wait`.
        """
        if self._closed or self._tmp is None:
            raise FabricError("the fabric is not up")
        nodes = list(range(len(self.nodes))) if nodes is None else list(nodes)
        self._jobs += 1
        run_id = f"{self.tag}-job{self._jobs}"
        base = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
        base["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        base["GLOO_SOCKET_IFNAME"] = NODE_IF
        base["PYTHONUNBUFFERED"] = "1"
        base.update(env or {})
        endpoint = f"{self.nodes[host].addr}:{TORCHRUN_PORT}"
        procs, logs = {}, {}
        started = time.monotonic()
        for i in nodes:
            node = self.nodes[i]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                   "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={1 if i == host else 0},join_timeout={join_timeout_s:g}",
                   "--local-addr", node.addr, "--max-restarts", "0",
                   *((workers or {}).get(i) or ["-m", module, *args])]
            out_path = Path(self._tmp) / f"job{self._jobs}-n{i}.out"
            err_path = Path(self._tmp) / f"job{self._jobs}-n{i}.err"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                procs[i] = self.popen(i, cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=base,
                                      cwd=self._tmp)
            logs[i] = (out_path, err_path)
        return TorchrunJob(self, procs, logs, started)
