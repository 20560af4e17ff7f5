"""The fused C decode kernel for CPU tensors (``cpu_decode.c``): built once per machine, loaded by ctypes.

``cpu_decode.decode_attention_cpu`` calls :func:`decode_native` for caches whose head dimension
is dense (contiguous or paged, one or several query tokens per row) when :func:`native_kernel` has
a library; everything else, and every machine without a C compiler, runs the torch path.

The build:

* the compiler is ``$CC``, else Python's configured one, else ``cc``; flags are ``-O3`` with
  reassociation (vectorised sums) but IEEE infinities and NaN kept, ``-march=native`` when the
  compiler accepts it (else without);
* the library is cached under ``$TREE_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/tree-attn``, else
  ``~/.cache/tree-attn``, named by a hash of the source, the compiler's version, the flags and the
  CPU (model and feature flags), so an upgrade or another machine sharing a home directory builds
  its own; one process builds while the others wait on a lock, and the library is linked in a
  temporary folder and renamed into place, so no process ever loads half a file;
* the source is compiled in six parts (the entry points, and each dtype's instances: see
  ``cpu_decode.c``), one compiler per usable CPU at a time, then linked: on the 2-core
  development VM (gcc 12, -O3) 20 s instead of 29 s for one compile of the whole; the parts take
  0.3-7.7 s alone, so with 5 or more CPUs the longest part bounds it;
* the build says so on stderr (one line);
* ``TREE_ATTN_CPU_KERNEL=torch`` turns it off (the torch path everywhere).

Why a C kernel and not a dependency: it is one file with no headers beyond libc's, it builds
once per machine with the compiler every Linux machine that runs CPU ranks has,
and none of the torch ops measured fuses the score pass, the softmax and ``p @ V`` (see
``cpu_decode.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.c")
ENV_SWITCH = "TREE_ATTN_CPU_KERNEL"
BASE_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-pthread",
)
BUILD_TIMEOUT_S = 180  # per compiler run
# The parts of cpu_decode.c compiled apart (its TREE_ATTN_PART: a dtype code, or -1 for the entry
# points), the longest first (fp8 7.7 s, bf16 6.2, f16 5.8, f32 5.2, the entry points 0.3 alone at
# -O3 on the development VM), so that the last to start are the short ones.
PARTS = (4, 3, 1, 2, 0, -1)

# Threads split the keys of each row into contiguous ranges (each streams its own part of the
# cache; their states are merged exactly, in C), but only ranges worth at least this much work:
# smaller ones cost more in starting a thread and merging (~70-100 us on the 2-core development VM)
# than they save. A range's work is its K and V bytes plus 4 per query row, head element and key
# (the multiply-adds: a GQA head's rows share each byte read). Fitted on that VM over 75 one-call
# cases (batch 1 and 4; heads 8/8 and 32/8 x 128, 8/2 and 9/3 x 64; 1K-16K keys; fp32, bf16, fp8),
# then checked with 1 and 2 threads interleaved call by call (RESULTS.md, "Threads per call"): the
# faster count in 18 of 22 cases, the misses within 13%, where the rule it replaced (2,048 keys per
# thread, whatever the heads) picked it in 12 and left 0.63x untaken. Splitting by KV heads
# instead (each thread reading 2 KiB of every 4 KiB token) was slower than one thread.
MIN_WORK_PER_THREAD = 8 << 20
# The most ranges one call splits into (cpu_decode.c's MAX_PARTS): a machine with more threads
# than this uses this many.
MAX_PARTS = 64


def work_per_key(batch: int, kv_heads: int, rows: int, head_dim: int, itemsize: int) -> int:
    """The work of one key position in every row (see :data:`MIN_WORK_PER_THREAD`): K and V bytes
    of ``kv_heads`` heads of ``itemsize``-byte elements, plus 4 per query row (``rows``: of all KV
    heads, Sq x Hq) and element."""
    return batch * head_dim * (2 * kv_heads * itemsize + 4 * rows)


def thread_parts(longest: int, work: int) -> int:
    """Key ranges (threads) for rows of at most ``longest`` keys, each key position worth ``work``
    (:func:`work_per_key`): one per torch intra-op thread, each worth at least
    :data:`MIN_WORK_PER_THREAD` and at least one key, at most :data:`MAX_PARTS`, at least 1."""
    return max(1, min(torch.get_num_threads(), longest * work // MIN_WORK_PER_THREAD, longest, MAX_PARTS))


# The C enum's codes.
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e4m3fnuz: 4}


@dataclass(frozen=True)
class NativeKernel:
    """A loaded build of ``cpu_decode.c``: its path, the flags it was built with, the dtypes it takes."""

    path: Path
    compiler: str
    flags: tuple[str, ...]
    dtypes: frozenset[torch.dtype]
    function: ctypes._CFuncPtr  # tree_attn_cpu_decode
    parts_function: ctypes._CFuncPtr  # tree_attn_cpu_decode_parts (one call, several threads)
    widen_function: ctypes._CFuncPtr | None = None  # tree_attn_cpu_widen (the tests check it on every code)
    widen_fp8_fast_function: ctypes._CFuncPtr | None = None  # tree_attn_cpu_widen_fp8_fast (AVX2 + F16C path)
    widen_wide_function: ctypes._CFuncPtr | None = None  # tree_attn_cpu_widen_wide (the 512-bit path)
    wide_function: ctypes._CFuncPtr | None = None  # tree_attn_cpu_wide (the 512-bit path on or off)

    def run(self, args: tuple, longest: int, parts: int, outs: torch.Tensor, lses: torch.Tensor) -> None:
        """The kernel over keys ``[0, longest)`` of every row on ``parts`` threads: ``args`` are
        the call's arguments up to the V strides; ``outs [parts, B, R, D]`` and ``lses [parts, B,
        R]`` float32 contiguous are scratch, and ``outs[0]``, ``lses[0]`` get the result (with
        several parts the C side starts the threads and merges their states exactly, see
        ``tree_attn_cpu_decode_parts``)."""
        if parts == 1:
            code = self.function(*args, 0, longest, outs.data_ptr(), lses.data_ptr())
        else:
            code = self.parts_function(*args, longest, parts, outs.data_ptr(), lses.data_ptr())
        if code == -1:
            raise MemoryError("the C decode kernel could not allocate its scratch memory")
        if code != 0:
            raise RuntimeError(f"the C decode kernel returned {code} ({parts} parts)")

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a CPU tensor of one of :attr:`dtypes`) as float32 with the kernel's own widening."""
        src = x.contiguous().reshape(-1)
        out = torch.empty(src.shape, dtype=torch.float32)
        if self.widen_function is None or self.widen_function(_DTYPE_CODES[x.dtype], src.data_ptr(), src.numel(),
                                                               out.data_ptr()) != 0:
            raise ValueError(f"this build of the C kernel cannot widen {x.dtype}")
        return out.view(x.shape)

    def widen_fp8_fast(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` (fp8, a multiple of 16 elements) as float32 through the decode loops' AVX2 + F16C
        fp8 path, NaN codes as that path alone would read them; None when this build has no such
        path."""
        return _widen_through(self.widen_fp8_fast_function, x)

    def widen_wide(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` (a multiple of 64 elements) as float32 through the 512-bit path's widening (AVX-512
        F, BW and VBMI builds; fp8 by byte tables, NaN codes included); None when this build has no
        such path."""
        return _widen_through(self.widen_wide_function, x)

    def use_wide(self, on: bool) -> bool:
        """Turn the 512-bit decode path on (the default) or off for the calls that follow, in this
        process (the tests run the other paths too); returns whether this build has it."""
        return bool(self.wide_function(int(on))) if self.wide_function is not None else False


def _widen_through(fn: ctypes._CFuncPtr | None, x: torch.Tensor) -> torch.Tensor | None:
    src = x.contiguous().reshape(-1)
    out = torch.empty(src.shape, dtype=torch.float32)
    code = -3 if fn is None else fn(_DTYPE_CODES[x.dtype], src.data_ptr(), src.numel(), out.data_ptr())
    return out.view(x.shape) if code == 0 else None


@dataclass(frozen=True)
class NativeStatus:
    """Whether the C kernel is in use, and why not when it is not (for reports and ``--json``)."""

    available: bool
    detail: str  # the library and its flags, or the reason it is off

    def describe(self) -> str:
        """One line for reports: ``C kernel: <library and flags>`` or ``torch ops: <why>``."""
        return f"C kernel: {self.detail}" if self.available else f"torch ops: {self.detail}"


_lock = threading.Lock()
_kernel: NativeKernel | None = None
_status: NativeStatus | None = None


def native_kernel() -> NativeKernel | None:
    """The C kernel, built on the first call of this process (about 20 s on 2 cores, once per machine) or
    loaded from the cache; None when it is turned off or cannot be built (:func:`native_status`
    says why)."""
    global _kernel, _status
    if _status is None:
        with _lock:
            if _status is None:
                try:
                    _kernel = _load()
                    _status = NativeStatus(True, f"{_kernel.path.name} ({_kernel.compiler} {' '.join(_kernel.flags)})")
                except _Unavailable as e:
                    _kernel, _status = None, NativeStatus(False, str(e))
    return _kernel


def native_status() -> NativeStatus:
    """:func:`native_kernel`'s outcome (building it if this process has not tried yet)."""
    native_kernel()
    assert _status is not None
    return _status


class _Unavailable(Exception):
    """The C kernel cannot be used here; the message says why."""


def _load() -> NativeKernel:
    if os.environ.get(ENV_SWITCH, "").strip().lower() == "torch":
        raise _Unavailable(f"turned off by {ENV_SWITCH}=torch")
    compiler = _compiler()
    version = _run([*compiler, "--version"], "asking the compiler its version").splitlines()[0:1]
    try:
        source = SOURCE.read_bytes()
    except OSError as e:
        raise _Unavailable(f"the kernel's source is missing from this install ({e})") from e
    cache = _cache_dir()
    errors = []
    for extra in (("-march=native",), ()):
        flags = (*BASE_FLAGS, *extra)
        key = hashlib.sha256(
            b"\0".join([source, " ".join(compiler).encode(), *(v.encode() for v in version), " ".join(flags).encode(),
                        _cpu_identity()])
        ).hexdigest()[:16]
        path = cache / f"cpu_decode-{key}.so"
        try:
            with _build_lock(cache):  # ranks starting together: one builds, the others wait for it
                if not path.exists():
                    print(f"tree-attn: building the CPU decode kernel for this machine, once (about 20 s on 2 cores, "
                          f"less on more): {path}",
                          file=sys.stderr, flush=True)
                    _build(compiler, flags, path)
        except _Unavailable as e:
            errors.append(str(e))
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            errors.append(f"loading {path.name}: {e}")
            continue
        return NativeKernel(path, " ".join(compiler), flags, _dtypes(lib), _bind(lib),
                            _bind(lib, "tree_attn_cpu_decode_parts"), _bind_widen(lib),
                            _bind_widen(lib, "tree_attn_cpu_widen_fp8_fast"),
                            _bind_widen(lib, "tree_attn_cpu_widen_wide"), _bind_switch(lib, "tree_attn_cpu_wide"))
    raise _Unavailable("; ".join(errors))


def _compiler() -> list[str]:
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    words = shlex.split(configured)
    for candidate in (words, ["cc"]):
        if candidate and shutil.which(candidate[0]):
            return candidate
    raise _Unavailable(f"no C compiler found ({configured!r} and 'cc' are not on PATH); set CC to one")


def _cache_dir() -> Path:
    root = os.environ.get("TREE_ATTN_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "tree-attn"
    path = base / "native"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Unavailable(f"cannot create the build cache {path}: {e}; "
                           "set TREE_ATTN_CACHE_DIR to a writable folder") from e
    return path


def _cpu_identity() -> bytes:
    """The CPU model and feature flags (a -march=native build runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(keep))).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _run(cmd: list[str], what: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _Unavailable(f"{what} failed: {e}") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise _Unavailable(f"{what} failed (exit {done.returncode}): {' / '.join(tail)}")
    return done.stdout


@contextlib.contextmanager
def _build_lock(folder: Path):
    """An exclusive lock on ``folder/.build.lock`` (POSIX ``flock``; released if the process dies).
    Without ``fcntl`` (Windows) no lock: concurrent builds then each write their own temporary file
    and the renames leave one whole library."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / ".build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(compiler: list[str], flags: tuple[str, ...], path: Path) -> None:
    """Compile the source's :data:`PARTS` at once (one compiler each, as many at a time as this
    process may use CPUs), link them in a temporary folder in the cache folder, then rename the
    library into place: readers see all or nothing."""
    with tempfile.TemporaryDirectory(prefix=path.stem + ".", suffix=".tmp", dir=path.parent) as folder:
        objects = [os.path.join(folder, f"part{i}.o") for i in range(len(PARTS))]

        def compile_part(part: int, obj: str) -> None:
            _run([*compiler, *flags, "-c", f"-DTREE_ATTN_PART={part}", str(SOURCE), "-o", obj],
                 f"compiling {SOURCE.name} (part {part}) with {' '.join(flags)}")

        with ThreadPoolExecutor(max_workers=min(len(PARTS), _usable_cpus())) as pool:
            done = [pool.submit(compile_part, part, obj) for part, obj in zip(PARTS, objects)]
        for future in done:
            future.result()  # the first part that failed, with its compiler's message
        tmp = os.path.join(folder, path.name)
        _run([*compiler, *flags, *objects, "-o", tmp, "-lm"], f"linking {path.name}")
        os.replace(tmp, path)


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _dtypes(lib: ctypes.CDLL) -> frozenset[torch.dtype]:
    lib.tree_attn_cpu_dtypes.restype = ctypes.c_int
    bits = lib.tree_attn_cpu_dtypes()
    return frozenset(dt for dt, code in _DTYPE_CODES.items() if bits & (1 << code))


def _bind(lib: ctypes.CDLL, name: str = "tree_attn_cpu_decode"):
    """The decode entry point, or ``tree_attn_cpu_decode_parts`` (the same arguments, the last two
    numbers ``longest, parts`` in place of ``t0, t1`` and the outputs the parts' scratch)."""
    fn = getattr(lib, name)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    # dt; q, k, v, lens, table; table_stride, bs, sq, causal, b, hkv, g, d, 3 + 3 strides, t0, t1; out, lse
    fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, *([i64] * 16), ptr, ptr]
    fn.restype = ctypes.c_int
    return fn


def _bind_optional(lib: ctypes.CDLL, name: str, argtypes: list):
    """``lib``'s function ``name`` returning an int, or None when this build lacks it."""
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return fn


def _bind_widen(lib: ctypes.CDLL, name: str = "tree_attn_cpu_widen"):
    return _bind_optional(lib, name, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])


def _bind_switch(lib: ctypes.CDLL, name: str):
    return _bind_optional(lib, name, [ctypes.c_int])


def decode_native(
    kernel: NativeKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one or several query tokens per row with the C kernel.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]`` CPU, any float dtype.
        k, v: ``[B, N, Hkv, D]`` CPU, one dtype of ``kernel.dtypes``, ``stride(-1) == 1``; with
            ``block_table``: pools ``[num_blocks, block_size, Hkv, D]``.
        lens: int64 ``[B]`` contiguous CPU, valid keys per row (0..N, checked by the caller).
        scale: the softmax scale.
        block_table: None, or integer ``[B, max_blocks]`` (row b's token t is in page
            ``block_table[b, t // block_size]``; every entry a row reads checked by the caller).
        causal: token i of a row sees its keys ``[0, len - Sq + 1 + i)`` (``reference.key_limits``).
        k_scale, v_scale: an fp8 cache's float32 ``[Hkv]`` scales, folded as the Triton kernel
            folds them: ``k_scale[h]`` into KV head h's query rows, ``v_scale[h]`` into their
            output (the kernel itself reads the stored values, widened exactly); None otherwise.

    Returns:
        ``out`` (q's shape) float32 and ``lse`` (q's shape without D) float32, natural log; query
        tokens that see no key give out 0 and lse -inf. With ``torch.get_num_threads() > 1`` and
        long rows, each row's keys are split into contiguous ranges, one per thread (started by
        the C side in one call, which releases the GIL), and the ranges' states merged exactly
        there (the merge of :func:`tree_attn.reduce.state.merge_states`).
    """
    b, sq, hq, d = q.shape if q.dim() == 4 else (q.shape[0], 1, *q.shape[1:])
    hkv = k.shape[2]
    g = hq // hkv
    # [B, Hkv * Sq * G, D]: a KV head's rows are its Sq tokens' G heads, token-major.
    qs = (q.float() * scale).reshape(b, sq, hkv, g, d).transpose(1, 2).reshape(b, hkv, sq * g, d)
    if k_scale is not None:
        qs = qs * k_scale.view(1, hkv, 1, 1)
    qs = qs.reshape(b, hkv * sq * g, d).contiguous()
    longest = int(lens.max()) if b else 0
    parts = thread_parts(longest, work_per_key(b, hkv, hkv * sq * g, d, k.element_size()))
    outs = torch.empty(parts, b, hkv * sq * g, d, dtype=torch.float32)
    lses = torch.empty(parts, b, hkv * sq * g, dtype=torch.float32)
    table = None if block_table is None else block_table.to(torch.int64).contiguous()
    args = (
        _DTYPE_CODES[k.dtype], qs.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(),
        None if table is None else table.data_ptr(), 0 if table is None else table.shape[1],
        k.shape[1] if table is not None else 0, sq, int(causal),
        b, hkv, sq * g, d, *k.stride()[:3], *v.stride()[:3],
    )  # fmt: skip
    kernel.run(args, longest, parts, outs, lses)
    out, lse = outs[0], lses[0]
    if v_scale is not None:
        out = out.view(b, hkv, sq * g, d).mul_(v_scale.view(1, hkv, 1, 1))
    # Back to q's layout: [B, Hkv, Sq, G, (D)] -> [B, Sq, Hkv * G, (D)].
    out = out.view(b, hkv, sq, g, d).transpose(1, 2).reshape(q.shape)
    lse = lse.view(b, hkv, sq, g).transpose(1, 2).reshape(q.shape[:-1])
    return out, lse


class NativeDecodePlan:
    """:func:`decode_native` for one call signature, resolved once (a prepared step's CPU path).

    Built from the signature's sizes (``q [B, (Sq,) Hq, D]``, KV ``[.., Hkv, D]`` of ``kv_dtype``,
    paged or not), it owns the scaled query, the lengths, the int64 block table and the threads'
    partial states, so a call allocates nothing, checks nothing and only reads the tensors' data
    pointers: it copies q (scaled) and the lengths in, runs the kernel on one or more threads, and
    writes ``out``/``lse`` in place (any layout with q's shape: a packed message's views too). The
    caller guarantees what :func:`decode_native` leaves to its caller: lengths 0..N and block-table
    entries inside the pool (checked once by the prepared object that builds this plan).
    """

    def __init__(self, kernel: NativeKernel, *, batch: int, q_len: int, q_heads: int, kv_heads: int,
                 head_dim: int, kv_dtype: torch.dtype, scale: float, causal: bool, tokens: bool,
                 table_cols: int = 0, block_size: int = 0) -> None:
        b, sq, hq, hkv, d = batch, q_len, q_heads, kv_heads, head_dim
        g = hq // hkv
        self.kernel, self.scale, self.tokens = kernel, float(scale), tokens
        self.b, self.sq, self.hq, self.hkv, self.g, self.d = b, sq, hq, hkv, g, d
        self.rows = hkv * sq * g
        self.qs = torch.empty(b, self.rows, d, dtype=torch.float32)
        self.lens = torch.empty(b, dtype=torch.int64)
        self.table = torch.empty(b, table_cols, dtype=torch.int64) if table_cols else None
        self._outs = self._lses = None  # the threads' partial states, sized on first use
        self._work = work_per_key(b, hkv, self.rows, d, kv_dtype.itemsize)
        self._head = (_DTYPE_CODES[kv_dtype], self.qs.data_ptr())
        self._mid = (self.lens.data_ptr(), None if self.table is None else self.table.data_ptr(), table_cols,
                     block_size if table_cols else 0, sq, int(causal and sq > 1), b, hkv, sq * g, d)

    def _buffers(self, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._outs is None or self._outs.shape[0] < parts:
            with torch.inference_mode(False):  # kept for later calls, in or out of inference mode
                self._outs = torch.empty(parts, self.b, self.rows, self.d, dtype=torch.float32)
                self._lses = torch.empty(parts, self.b, self.rows, dtype=torch.float32)
        return self._outs, self._lses

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None,
                 block_table: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor) -> None:
        b, sq, hkv, g, d = self.b, self.sq, self.hkv, self.g, self.d
        # Widened to float32 first, then scaled (as decode_native does: q.float() * scale).
        if sq == 1:  # rows are the heads in order: q [B, (1,) Hq, D] is already [B, Hkv * G, D]
            self.qs.copy_(q.reshape(b, self.rows, d))
        else:  # [B, Sq, Hkv, G, D] -> [B, Hkv, Sq, G, D]
            self.qs.view(b, hkv, sq, g, d).copy_(q.reshape(b, sq, hkv, g, d).transpose(1, 2))
        self.qs.mul_(self.scale)
        if seq_lens is None:  # a contiguous cache read whole
            self.lens.fill_(k.shape[1])
        else:
            self.lens.copy_(seq_lens)
        if self.table is not None:
            self.table.copy_(block_table)
        longest = int(self.lens.max()) if b else 0
        parts = thread_parts(longest, self._work)
        outs, lses = self._buffers(parts)
        args = (*self._head, k.data_ptr(), v.data_ptr(), *self._mid, *k.stride()[:3], *v.stride()[:3])
        self.kernel.run(args, longest, parts, outs, lses)
        o, l = outs[0], lses[0]
        if sq == 1:  # [B, Hkv * G, (D)] is q's [B, (1,) Hq, (D)]
            out.copy_(o.view(out.shape))
            lse.copy_(l.view(lse.shape))
        else:  # [B, Hkv, Sq, G, (D)] -> [B, Sq, Hkv, G, (D)]
            out.unflatten(-2, (hkv, g)).copy_(o.view(b, hkv, sq, g, d).transpose(1, 2))
            lse.unflatten(-1, (hkv, g)).copy_(l.view(b, hkv, sq, g).transpose(1, 2))
