"""Faults end cleanly (issue "Hardening", items 2, 3, 10): SIGTERM to `tree-attn run`, a stopped
rank, the parent killed with SIGKILL, a result larger than a pipe, a long healthy run; gloo of
self-launched ranks on loopback only. The CLI runs as a subprocess with its own TMPDIR, so the
rendezvous folder it leaves (or not) can be seen; rank processes are checked by PID.

Linux only (signals, /proc). Each run is small: two CPU ranks, tiny shapes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.dist.rank_fns import big_result, own_tcp_addresses, sleeps, stops_itself
from tests.processes import alive, gone
from tree_attn.errors import DistributedError
from tree_attn.launch import spawn as launch
from tree_attn.launch.spawn import launch_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc: Linux")

# A run that lasts until it is stopped: two CPU ranks, a small cache, a billion steps.
ENDLESS = [sys.executable, "-m", "tree_attn", "run", "--device", "cpu", "-w", "2", "-n", "4096", "--heads", "8",
           "--kv-heads", "2", "--head-dim", "32", "--strategy", "tree", "--steps", "1000000000", "--timeout", "4"]


def _ranks_of(pid: int) -> list[int]:
    """PIDs of the rank processes ``pid`` spawned (not multiprocessing's resource tracker)."""
    ranks = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            ranks.append(int(entry))
    return ranks


class _Run:
    """``tree-attn run`` as a subprocess, its stderr read line by line as it comes."""

    def __init__(self, tmp_path: Path, argv: list[str] = ENDLESS) -> None:
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        env = dict(os.environ, TMPDIR=str(self.tmpdir), CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in ln for ln in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} on stderr:\n" + "\n".join(self.lines)
            time.sleep(0.1)

    def ranks(self) -> list[int]:
        ranks = _ranks_of(self.proc.pid)
        assert len(ranks) == 2, ranks
        return ranks

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def _endless_run(tmp_path: Path):
    """An endless ``tree-attn run`` once its ranks decode: ``(run, rank pids)``; on leaving, every
    rank still alive (stopped ones too) is killed and the run reaped."""
    run = _Run(tmp_path)
    ranks: list[int] = []
    try:
        run.wait_for("[rank 0] tree")
        ranks = run.ranks()
        yield run, ranks
    finally:
        for p in ranks:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        run.stop()


def test_sigterm_to_run_stops_the_ranks_and_exits_143(tmp_path):
    with _endless_run(tmp_path) as (run, ranks):
        run.proc.send_signal(signal.SIGTERM)
        code = run.proc.wait(timeout=30)
        time.sleep(0.2)  # the reader thread takes the last line
        assert code == 128 + signal.SIGTERM
        assert run.lines[-1] == "error: terminated (SIGTERM)", run.lines[-3:]
        assert not any("Traceback" in ln for ln in run.lines)
        assert gone(ranks, within=5), [p for p in ranks if alive(p)]
        assert list(run.tmpdir.iterdir()) == []  # the rendezvous folder is removed


def test_ctrl_c_while_the_ranks_start_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C signals the terminal's whole foreground group, the ranks included, maybe while they
    still import torch (before any code of ours runs in them). Here the ranks are signalled first,
    then the parent (an order the terminal's delivery may take): no rank prints a KeyboardInterrupt
    traceback (each printed one, then died, and the run said "rank 0 died"), the run ends with
    one line and 130, and no rank remains."""
    run = _Run(tmp_path)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2:
            assert run.proc.poll() is None and time.monotonic() < deadline, "\n".join(run.lines)
            time.sleep(0.02)
            ranks = _ranks_of(run.proc.pid)
        assert not any(ln.startswith("[rank 0]") for ln in run.lines)  # still starting
        for pid in ranks:
            os.kill(pid, signal.SIGINT)
        time.sleep(1.0)  # the parent gives a dead rank 2 s to report before it fails the run
        run.proc.send_signal(signal.SIGINT)
        code = run.proc.wait(timeout=30)
        time.sleep(0.2)  # the reader thread takes the last line
        assert not any("Traceback" in ln or "KeyboardInterrupt" in ln for ln in run.lines), "\n".join(run.lines)
        assert code == 128 + signal.SIGINT and run.lines[-1] == "error: interrupted", run.lines[-3:]
        assert gone(ranks, within=5), [p for p in ranks if alive(p)]
        assert list(run.tmpdir.iterdir()) == []
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        run.stop()


def test_a_stopped_rank_ends_the_run_with_an_error_within_the_timeout(tmp_path):
    with _endless_run(tmp_path) as (run, ranks):
        stopped = max(ranks)  # rank 1 (spawned second)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        code = run.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        time.sleep(0.2)
        assert code == 1
        last = run.lines[-1]
        assert last.startswith("error: rank ") and "no heartbeat from rank" in last, run.lines[-3:]
        assert elapsed < 4 + 10, elapsed  # --timeout 4, plus reaping
        assert gone(ranks, within=5)  # the stopped rank too
        assert list(run.tmpdir.iterdir()) == []


def test_ranks_die_with_their_parent_and_remove_the_rendezvous_folder(tmp_path):
    with _endless_run(tmp_path) as (run, ranks):
        assert len(list(run.tmpdir.iterdir())) == 1  # the rendezvous folder, while the run lives
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(timeout=10)
        assert gone(ranks, within=5), [p for p in ranks if alive(p)]
        deadline = time.monotonic() + 5
        while list(run.tmpdir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(run.tmpdir.iterdir()) == []


def test_results_larger_than_a_pipe_are_drained():
    nbytes = 8 * 2**20  # 8 MiB each, a pipe holds 64 KiB
    assert [len(r) for r in launch_ranks(big_result, 2, args=(nbytes,), timeout_s=30)] == [nbytes, nbytes]


def test_the_parent_bounds_silence_not_work(monkeypatch):
    """A rank busy for longer than timeout + margin finishes (it beats); a stopped rank (no
    beats) is given up after timeout + margin, with an error naming it."""
    monkeypatch.setattr(launch, "SILENCE_MARGIN_S", 1.0)
    assert launch_ranks(sleeps, 1, args=(4.0,), timeout_s=1.0) == [0]
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 sent no heartbeat for \d+ s"):
        launch_ranks(stops_itself, 1, timeout_s=1.0)
    assert time.monotonic() - t0 < 20


def test_self_launched_gloo_listens_on_loopback_only():
    lo = launch.loopback_interface()
    if lo is None:
        pytest.skip("no loopback interface found")
    for ifname, addresses in launch_ranks(own_tcp_addresses, 2, timeout_s=30):
        assert ifname == lo
        assert addresses, "gloo's sockets were not found"
        # 127.0.0.1 is 0100007F in /proc/net/tcp (little-endian); ::1 or v4-mapped 127.0.0.1 in tcp6
        loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
        assert set(addresses) <= loopback, addresses
