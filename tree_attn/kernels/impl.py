"""Which implementation of local decode attention runs on which tensors."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError, KernelUnavailableError

IMPLS = ("auto", "torch", "triton")


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` ("auto" | "torch" | "triton") to the one that will run on ``device``."""
    if impl not in IMPLS:
        raise ConfigError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "auto":
        # torch.cuda covers ROCm too (HIP tensors report device type "cuda").
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise KernelUnavailableError(
            f"impl='triton' needs CUDA or ROCm tensors; these are on {device}. "
            "Use impl='torch' (or 'auto'), or set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter."
        )
    return impl
