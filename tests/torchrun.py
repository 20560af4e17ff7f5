"""The CLI as a torchrun job from the tests: nodes on this host (c10d rendezvous on loopback), an
environment without a caller's torchrun variables, a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

# What torchrun sets in each rank; left in a shell they would make the CLI join a job.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables, with ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(extra)
    return env


def run_nodes(argv: list[str], *, nodes: int, per_node: int, env: dict[str, str], cwd, timeout: float,
              rdzv_id: str = "tree-attn-test") -> list[tuple[int, str, str]]:
    """``python -m tree_attn ARGV`` as a torchrun job of ``nodes`` x ``per_node`` ranks on this
    host; each node's ``(exit code, stdout, stderr)``. Each torchrun runs in its own process group:
    a failure or a timeout kills torchrun and its ranks together."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
               "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", rdzv_id, "-m", "tree_attn", *argv]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=cwd, start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
