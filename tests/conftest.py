"""Session-wide test settings, and the rules that keep the suite green with and without GPUs.

1. One Triton mode per pytest process, decided here, once, before anything imports triton:
   no GPU visible -> Triton's CPU interpreter (TRITON_INTERPRET=1), kernels run on CPU tensors;
   a GPU visible  -> compiled kernels on the GPU, TRITON_INTERPRET removed from the environment.
   Triton fixes the mode of a ``@triton.jit`` function when it is decorated (its own library
   functions when triton is imported, ours when ``tree_attn.kernels.triton_decode`` is), so one
   process cannot use both: mixing them fails with "InterpreterError: Cannot call @triton.jit'd
   outside of the scope of a kernel". Hence tests that reach Triton take the ``device`` fixture
   (cuda when there is a GPU) and never call it on CPU tensors when a GPU is present; they never
   set TRITON_INTERPRET=1 or reload triton_decode. (Deleting TRITON_INTERPRET inside a test, to
   check the error for CPU tensors without the interpreter, is fine: nothing is decorated then.)
   A test that can only mean the interpreter runs it in a subprocess with CUDA_VISIBLE_DEVICES=""
   and TRITON_INTERPRET=1 (the ``interpreter_subprocess`` fixture).
2. Tests that mean CPU ranks say so: ``tree-attn run --device cpu``, ``tree-attn tune --device
   cpu``, ``tree-attn probe --backend host``. Left to ``auto``, the CLI takes the GPUs when there
   are any, and a test of 3 CPU ranks asks a one-GPU machine for 3 GPUs.
3. GPU tests are marked ``gpu``, use the GPUs that are there and skip with a reason naming what
   is missing ("needs a GPU", "needs 2 GPUs"). A CPU test is never skipped on a GPU machine.
4. The CPU C kernel (``tree_attn.kernels.cpu_native``) is built, or found in the cache, once here
   before any test runs: its first build (~30 s) then happens in no test's timing or output, and
   not in several spawned ranks at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_MODULE = "tree_attn.kernels.triton_decode"
TRITON_MODE = "compiled" if HAS_GPU else "interpreter"


def _set_process_mode() -> None:
    triton_imported_before = "triton" in sys.modules
    if HAS_GPU:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    if not HAS_TRITON:
        return  # tests that need triton skip themselves (importorskip)
    if not HAS_GPU and triton_imported_before:
        raise pytest.UsageError(
            "triton was imported (compiled mode) before tests/conftest.py could choose its CPU interpreter; "
            "run pytest in a fresh process without plugins that import triton"
        )
    # Decorate the kernels now, in this process's mode (this imports triton too, if not yet).
    importlib.import_module(TRITON_MODULE)
    if _kernel_mode() != TRITON_MODE:
        raise pytest.UsageError(f"{TRITON_MODULE} was decorated for the {_kernel_mode()}, not the {TRITON_MODE} mode")


def _kernel_mode() -> str | None:
    """``interpreter`` or ``compiled``: how our kernels were decorated (None: not imported)."""
    mod = sys.modules.get(TRITON_MODULE)
    if mod is None:
        return None
    return "interpreter" if "Interpreted" in type(mod.split_kv_stage1_kernel).__name__ else "compiled"


_set_process_mode()

from tree_attn.kernels.cpu_native import native_status

native_status()


@pytest.fixture(scope="session", autouse=True)
def _subprocess_tmpdir():
    """Processes the tests start put their temporary files in a folder of this session, removed at
    its end: torchrun's agent leaves a ``torchelastic_*`` folder in the temporary folder of every
    job it runs. This process keeps the temporary folder it already had (pytest's own is there)."""
    tempfile.gettempdir()  # fixed now, before TMPDIR changes: only child processes read the new one
    folder = tempfile.mkdtemp(prefix="tree-attn-tests-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _private_profile_dir(tmp_path, monkeypatch):
    """Keep tests away from the user's saved profiles: every test gets an empty profile folder."""
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(tmp_path / "profile-cache"))


@pytest.fixture(autouse=True)
def _one_triton_mode(monkeypatch):
    """Every test starts in the process's Triton mode (the launcher reads TRITON_INTERPRET at call
    time), and no test may leave kernels decorated in the other mode."""
    if HAS_GPU:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    mode = _kernel_mode()
    assert mode in (None, TRITON_MODE), (
        f"{TRITON_MODULE} is decorated for the {mode} but this process runs Triton {TRITON_MODE}: "
        "a test reloaded it or set TRITON_INTERPRET (see the rules in tests/conftest.py)"
    )


@pytest.fixture
def device() -> torch.device:
    """Where tests that reach Triton compute: the GPU if any (compiled kernels), else the CPU
    (Triton's interpreter)."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")


# NumPy >= 2.4 refuses int() of a one-element array, which Triton's interpreter of some releases
# (3.6, which torch 2.11 pins) does for every loop bound read from a tensor.
_INTERPRETER_NUMPY_BREAK = "only 0-dimensional arrays can be converted to Python scalars"


@pytest.fixture(params=["wide", "other"])
def c_kernel_path(request):
    """Which of the C kernel's paths the test's calls take: its 512-bit path ("wide", on AVX-512 F,
    BW and VBMI builds, where it applies: the default there) or the others ("other": AVX2 + F16C
    fp8, compiler-vectorised loops), so that one machine checks both. "wide" skips, saying why,
    where the build has no such path; the path is back on after the test."""
    from tree_attn.kernels import cpu_native

    kernel = cpu_native.native_kernel()
    if kernel is None:
        pytest.skip(f"the C kernel is not built here: {cpu_native.native_status().detail}")
    has_wide = kernel.use_wide(request.param == "wide")
    try:
        if request.param == "wide" and not has_wide:
            pytest.skip("this build of the C kernel has no 512-bit path (needs AVX-512 F, BW and VBMI)")
        yield request.param
    finally:
        kernel.use_wide(True)


@pytest.fixture
def interpreter_subprocess():
    """Run Python ``code`` in a fresh process that sees no GPU and runs Triton's interpreter;
    returns its stdout (a failure shows its stderr). For tests that can only mean the interpreter."""
    pytest.importorskip("triton")

    def run(code: str, timeout: float = 300) -> str:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                              check=False)
        if proc.returncode != 0 and _INTERPRETER_NUMPY_BREAK in proc.stderr and "interpreter.py" in proc.stderr:
            import numpy
            import triton

            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run with NumPy {numpy.__version__} "
                        f"(it calls int() on a one-element array: {_INTERPRETER_NUMPY_BREAK}); an incompatibility "
                        "between those two packages, not this project's: newer Triton or NumPy < 2.4 runs it")
        assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stderr[-4000:]}"
        return proc.stdout

    return run


# Failures written as they happen, for runs that may be stopped before pytest's own report (a GPU
# machine lent for a few minutes, a CI job at its time limit): with TREE_ATTN_FAILURE_LOG set, each
# failing test's id and traceback are appended to that file the moment it fails. Under pytest-xdist
# the workers append to the same file, one whole record per write (the controller, which receives
# each worker's reports again, marked with the worker ``node``, writes none).
_FAILURE_LOG = os.environ.get("TREE_ATTN_FAILURE_LOG")


def pytest_runtest_logreport(report):
    if not _FAILURE_LOG or not report.failed or hasattr(report, "node"):
        return
    record = f"=== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n"
    with open(_FAILURE_LOG, "a", encoding="utf-8") as log:
        log.write(record)
