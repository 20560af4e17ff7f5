"""The rank environment read from torchrun's variables honours the run's device and backend."""

from __future__ import annotations

import pytest

from tree_attn.errors import ConfigError
from tree_attn.launch import env as launch
from tree_attn.launch.env import rank_cuda_device, resolve_backend, torchrun_env


def test_not_under_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert torchrun_env() is None


def test_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = torchrun_env("cpu")
    assert (env.rank, env.world_size, env.local_rank, env.device, env.backend) == (3, 4, 1, "cpu", "gloo")
    # A GPU host: the local rank picks the device, nccl by default; gloo cannot send GPU tensors.
    monkeypatch.setattr(launch, "gpu_count", lambda: 2)
    env = torchrun_env()
    assert (env.device, env.backend) == ("cuda:1", "nccl")
    with pytest.raises(ConfigError, match="gloo backend cannot send GPU tensors"):
        torchrun_env("cuda", "gloo")
    # --device cpu on a GPU host stays on CPU ranks
    assert torchrun_env("cpu").device == "cpu"
    with pytest.raises(ConfigError, match="nccl backend needs GPU ranks"):
        torchrun_env("cpu", "nccl")


def test_rank_cuda_device_with_one_visible_gpu_per_process():
    """torchrun on a node whose processes see all its GPUs: LOCAL_RANK picks one. A launcher that
    gives each process one GPU (SLURM --gpus-per-task=1) renumbers it cuda:0 in every process."""
    assert [rank_cuda_device(r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [rank_cuda_device(r, 1) for r in range(8)] == ["cuda:0"] * 8
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this process sees 2 GPUs.*--nproc-per-node 2"):
        rank_cuda_device(2, 2)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        rank_cuda_device(0, 0)


def test_torchrun_env_with_one_visible_gpu(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    env = torchrun_env()
    assert (env.device, env.local_rank, env.backend) == ("cuda:0", 5, "nccl")
    monkeypatch.setattr(launch, "gpu_count", lambda: 4)
    with pytest.raises(ConfigError, match="LOCAL_RANK=5 but this process sees 4 GPUs"):
        torchrun_env("cuda")


def test_resolve_backend():
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(ConfigError, match="backend must be one of"):
        resolve_backend("mpi", "cpu")


_REINIT_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from tree_attn import tree_decode
from tree_attn.reduce import collectives
from tree_attn.launch.group import close_process_group

def init(path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)

q = torch.randn(1, 4, 16); k = torch.randn(1, 9, 2, 16); v = torch.randn(1, 9, 2, 16)
init(sys.argv[1])
first = dist.group.WORLD
out1, _ = tree_decode(q, k, v)
assert len(collectives._MERGES) == 1 and next(iter(collectives._MERGES))[0] is first
close_process_group()
assert not collectives._MERGES and not dist.is_initialized()
init(sys.argv[2])
out2, _ = tree_decode(q, k, v)
# a new default group is a new key: the merge is rebuilt, never reused from the destroyed group
assert len(collectives._MERGES) == 1 and next(iter(collectives._MERGES))[0] is dist.group.WORLD is not first
assert torch.equal(out1, out2)
close_process_group()
print("ok")
"""


def test_close_process_group_drops_merges_and_a_new_group_builds_its_own(tmp_path):
    """CPU ranks (gloo, world size 1, one subprocess). Cached merges are keyed by the group object
    and dropped by close_process_group, so none outlives (or is reused after) its group."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _REINIT_SCRIPT, str(tmp_path / "a"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
