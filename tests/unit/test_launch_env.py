"""The rank environment read from torchrun's variables honours the run's device and backend."""

from __future__ import annotations

import pytest

from tree_attn.errors import ConfigError
from tree_attn.ranks import launch
from tree_attn.ranks.launch import resolve_backend, torchrun_env


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
    # A GPU host: the local rank picks the device, nccl by default, gloo when asked for.
    monkeypatch.setattr(launch, "gpu_count", lambda: 2)
    env = torchrun_env()
    assert (env.device, env.backend) == ("cuda:1", "nccl")
    assert torchrun_env("cuda", "gloo").backend == "gloo"
    # --device cpu on a GPU host stays on CPU ranks
    assert torchrun_env("cpu").device == "cpu"
    with pytest.raises(ConfigError, match="nccl backend needs GPU ranks"):
        torchrun_env("cpu", "nccl")


def test_resolve_backend():
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(ConfigError, match="backend must be one of"):
        resolve_backend("mpi", "cpu")
