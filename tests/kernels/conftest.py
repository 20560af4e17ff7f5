"""Kernel tests run the Triton kernel on the GPU when there is one, else in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated: triton's own library
functions when triton is first imported, ours when ``tree_attn.kernels.triton_decode`` is. So
without a GPU it is set here, before either import (nothing under ``tree_attn`` imports triton
eagerly), and kept set by an autouse fixture while these tests run; the process environment is
restored afterwards so that tests elsewhere see the environment they started with.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        name = "tree_attn.kernels.triton_decode"
        if name in sys.modules:
            # Imported earlier without the interpreter: decorate again, interpreted.
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


# Look for triton without importing it: it must first be imported with TRITON_INTERPRET set, or
# its own library functions (the reductions' combine functions) are built for the compiler and the
# interpreter cannot call them. Where it is missing (macOS), the tests needing it skip themselves.
HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON and not HAS_GPU:
    _import_kernels_interpreted()


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """Without a GPU, every kernel test runs with TRITON_INTERPRET=1 (dispatch checks it at call time)."""
    if not HAS_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def device() -> torch.device:
    """Where the small correctness tests run: the GPU if any, else the CPU (interpreter)."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")

