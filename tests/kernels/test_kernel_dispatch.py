"""``decode_attention``'s choice of implementation, and lazy import of triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.tolerances import assert_decode_close, tol_for
from tree_attn.errors import ConfigError, KernelUnavailableError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.dispatch import decode_attention, resolve_impl
from tree_attn.kernels.reference import decode_attention_torch


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k = torch.randn(2, 20, 2, 64, generator=g)
    v = torch.randn(2, 20, 2, 64, generator=g)
    return q.to(device), k.to(device), v.to(device)


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


def test_triton_impl_runs_with_config_and_auto_picks_by_device(device):
    """impl="triton" with an explicit config, on this process's Triton device (compiled on a GPU,
    the interpreter on CPU); impl="auto" is the kernel on GPU tensors and torch on CPU ones."""
    pytest.importorskip("triton")
    q, k, v = _inputs(device)
    lens = torch.tensor([20, 3], device=device)
    out, lse = decode_attention(q, k, v, seq_lens=lens, impl="triton", config=DecodeConfig(block_n=16, num_splits=2))
    ref_out, ref_lse = decode_attention_torch(q, k, v, seq_lens=lens)
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device=device), what="dispatch triton")
    auto_out, auto_lse = decode_attention(q, k, v, seq_lens=lens)
    expected = "triton" if device.type == "cuda" else "torch"
    want_out, want_lse = decode_attention(q, k, v, seq_lens=lens, impl=expected)
    assert torch.equal(auto_out, want_out) and torch.equal(auto_lse, want_lse)


def test_triton_on_cpu_tensors_under_the_interpreter(interpreter_subprocess):
    """The interpreter path on CPU tensors (TRITON_INTERPRET=1 set before triton is imported),
    in a process of its own: a GPU process runs Triton compiled and cannot also interpret."""
    code = (
        "import torch\n"
        "from tree_attn.kernels.config import DecodeConfig\n"
        "from tree_attn.kernels.dispatch import decode_attention\n"
        "from tree_attn.kernels.reference import decode_attention_float64\n"
        "assert not torch.cuda.is_available()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q = torch.randn(2, 4, 64, generator=g)\n"
        "k = torch.randn(2, 20, 2, 64, generator=g)\n"
        "v = torch.randn(2, 20, 2, 64, generator=g)\n"
        "lens = torch.tensor([20, 0])\n"
        "out, lse = decode_attention(q, k, v, seq_lens=lens, impl='triton',\n"
        "                            config=DecodeConfig(block_n=16, num_splits=2))\n"
        "ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)\n"
        "print(float((out[0].double() - ref_out[0]).abs().max()), float((lse[0].double() - ref_lse[0]).abs().max()),\n"
        "      bool((out[1] == 0).all()), bool(torch.isneginf(lse[1]).all()))\n"
    )
    out_err, lse_err, empty_out, empty_lse = interpreter_subprocess(code).split()
    assert float(out_err) <= 2e-5 and float(lse_err) <= 2e-5
    assert empty_out == "True" and empty_lse == "True"


def test_launcher_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from tree_attn.kernels.triton_launch import decode_attention_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _inputs()
    with pytest.raises(KernelUnavailableError, match="impl='torch'"):
        decode_attention_triton(q, k, v, config=DecodeConfig(block_n=16, num_splits=1))


def test_bad_config_type_is_rejected(device):
    q, k, v = _inputs(device)
    with pytest.raises(ConfigError, match="DecodeConfig"):
        decode_attention(q, k, v, impl="triton", config={"block_n": 16})


def test_import_does_not_import_triton():
    code = (
        "import sys, tree_attn; "
        "from tree_attn.kernels import config, dispatch; from tree_attn.cost import kernel; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
