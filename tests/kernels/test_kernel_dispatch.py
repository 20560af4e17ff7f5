"""``decode_attention``'s choice of implementation, and lazy import of triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernel_tolerances import TOLERANCES, assert_decode_close
from tree_attn.errors import ConfigError, KernelUnavailableError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.dispatch import decode_attention, resolve_impl
from tree_attn.kernels.reference import decode_attention_torch


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k = torch.randn(2, 20, 2, 64, generator=g)
    v = torch.randn(2, 20, 2, 64, generator=g)
    return q, k, v


def test_auto_picks_triton_on_gpu_devices_and_torch_on_cpu():
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    # ROCm tensors are device type "cuda" too.
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("torch", torch.device("cuda", 0)) == "torch"


def test_unknown_impl():
    with pytest.raises(ConfigError, match="'cutlass'"):
        resolve_impl("cutlass", torch.device("cpu"))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _inputs()
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        decode_attention(q, k, v, impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError):
        decode_attention(q, k, v, impl="triton")


def test_triton_on_cpu_under_interpreter_runs_with_config(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _inputs()
    lens = torch.tensor([20, 3])
    out, lse = decode_attention(q, k, v, seq_lens=lens, impl="triton", config=DecodeConfig(block_n=16, num_splits=2))
    ref_out, ref_lse = decode_attention_torch(q, k, v, seq_lens=lens)
    assert_decode_close(out, lse, ref_out, ref_lse, TOLERANCES[torch.float32], what="dispatch triton")
    auto_out, auto_lse = decode_attention(q, k, v, seq_lens=lens)  # CPU tensors: torch
    assert torch.equal(auto_out, ref_out) and torch.equal(auto_lse, ref_lse)


def test_launcher_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from tree_attn.kernels.triton_launch import decode_attention_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _inputs()
    with pytest.raises(KernelUnavailableError, match="impl='torch'"):
        decode_attention_triton(q, k, v, config=DecodeConfig(block_n=16, num_splits=1))


def test_bad_config_type_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _inputs()
    with pytest.raises(ConfigError, match="DecodeConfig"):
        decode_attention(q, k, v, impl="triton", config={"block_n": 16})


def test_import_does_not_import_triton():
    code = (
        "import sys, tree_attn; "
        "from tree_attn.kernels import config, perf_model, dispatch; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
