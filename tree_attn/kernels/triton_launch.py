"""Host side of the Triton split-KV decode kernel: validation, config, buffers, grids, launches.

Imported lazily by ``dispatch.decode_attention`` (and by tests/benchmarks), so that triton is only
needed when the Triton path actually runs.
"""

from __future__ import annotations

import math

import torch

from ..cost.devices import DeviceSpec
from ..errors import ConfigError, KernelUnavailableError
from .config import (
    STAGE2_SPLIT_TILE,
    DecodeConfig,
    dot_math,
    group_block,
    group_blocks_for,
    padded_head_dim,
    resolve_config,
    split_len,
)
from .device_info import device_spec_for, is_rocm
from .impl import triton_interpreter_enabled
from .layout import OutLayout
from .shapes import FP8_DTYPES, check_decode_inputs, resolve_scale

# The kernel works in base 2 (exp2 is the native instruction): the launcher folds log2(e) into the scale.
LOG2E = math.log2(math.e)

# What a launch can be built for (see TritonDecodeLaunch's ``backend``).
BACKENDS = ("cuda", "hip", "interpreter")

# Stage two is a small reduction ([S, D] fp32 per program); 4 warps cover D=256 in one pass.
STAGE2_NUM_WARPS = 4


class TritonDecodeLaunch:
    """One shape signature's Triton decode, resolved once: config, split count, grid, constant
    launch arguments and the split partials' workspace. ``__call__`` only launches.

    Built from example tensors; later calls must pass tensors with the same shapes, strides,
    dtypes and device (``kernels.prepared`` keys its cache on exactly those), and the same
    seq_lens presence. ``__call__`` then reads no tensor property but data pointers.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]``; k, v: ``[B, N, Hkv, D]`` (any strides), or with
            ``block_table`` pools ``[num_blocks, block_size, Hkv, D]``; seq_lens: ``[B]`` integer
            or None (required when paged).
        block_table: ``[B, max_blocks]`` integer (int32 at call time), or None.
        causal: token i of Sq sees keys ``[0, seq_len - Sq + 1 + i)``.
        scale: softmax scale, default ``D ** -0.5``.
        config: a :class:`DecodeConfig`; ``None`` = :func:`config.default_config`, and a config
            with ``num_splits=None`` gets the split heuristic.
        device_spec: override the device facts the heuristic uses (default: read from q's device).
        out_layout: where ``out``/``lse`` live (default: ``out [B, Hq, D]`` contiguous in q's
            dtype, ``lse [B, Hq]`` contiguous); e.g. the views of a packed ``[B, Hq, D + 1]``
            float32 message, so the kernel writes the state the reduction sends.
        backend: what the kernel is built for: ``None`` (default) derives it from q's device and
            ``TRITON_INTERPRET``; ``"cuda"`` or ``"hip"`` plan a GPU launch from tensors on any
            device (ahead-of-time compiles: the arguments, hence Triton's specialisations, are
            the ones a launch on that GPU derives), ``"interpreter"`` Triton's CPU interpreter.
        k_scale, v_scale: for an fp8 cache (``torch.float8_e4m3fn``; ``float8_e4m3fnuz`` on
            ROCm), its float32 dequantization scales ``[Hkv]`` (contiguous, on q's device; the
            stored value times its head's scale is the cache's value); None for any other cache.
            Their values are read by the kernel at every call (never here), so a caller may
            update them in place between calls, CUDA-graph replays included.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None,
        *, scale: float | None = None, config: DecodeConfig | None = None, device_spec: DeviceSpec | None = None,
        out_layout: OutLayout | None = None, block_table: torch.Tensor | None = None, causal: bool = False,
        backend: str | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        self.fp8 = k.dtype in FP8_DTYPES
        _check_scales(self.fp8, k, q.device, shape.kv_heads, k_scale, v_scale)
        self.shape = shape
        b, hq, hkv, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
        if d == 0:
            raise ConfigError("head dim D must be at least 1")
        scale = resolve_scale(scale, d)
        spec = device_spec if device_spec is not None else device_spec_for(q.device)
        cfg = resolve_config(config, shape, k.dtype, spec, q_dtype=q.dtype)
        planned_only = backend is not None  # a plan for a build, not necessarily run on q's device
        if backend is None:
            backend = "interpreter" if triton_interpreter_enabled() else ("hip" if is_rocm() else "cuda")
        elif backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)} or None; got {backend!r}")
        if self.fp8:
            _check_fp8_backend(k.dtype, backend, None if planned_only else q.device)
        rocm = backend == "hip"
        interpret = backend == "interpreter"
        if cfg.waves_per_eu is not None and not rocm and not interpret:
            raise ConfigError(
                f"DecodeConfig.waves_per_eu={cfg.waves_per_eu} is an AMD (ROCm) option; "
                f"set it to None on this device ({q.device})"
            )
        self.config = cfg
        self.device = q.device
        self.out_layout = out_layout or OutLayout(q.dtype)
        self.tokens = q.dim() == 4
        sq = shape.q_len
        # Nothing to launch: no rows/heads, or no keys anywhere (the empty state, written without a
        # launch: a zero-length K, or an empty pool, has no storage to point at).
        self.trivial = b * hq == 0 or n == 0 or (shape.paged and shape.num_blocks == 0)
        if self.trivial:
            return
        if q.device.type != "cuda" and not planned_only and not interpret:
            raise KernelUnavailableError(
                f"the Triton decode kernel needs CUDA or ROCm tensors; these are on {q.device}. "
                "Use tree_attn.decode_attention(..., impl='torch'), or set TRITON_INTERPRET=1 before importing triton."
            )
        num_splits = cfg.num_splits
        assert num_splits is not None  # resolve_config fills it
        block_d = padded_head_dim(d)
        _check_tile_offsets(k, v, cfg.block_n, block_d)
        self.num_splits = num_splits
        self.has_lens = seq_lens is not None
        self.paged = shape.paged
        # The Sq tokens' GROUP heads are the rows of one program's tile (see triton_decode).
        g_blocks = group_blocks_for(shape.query_rows)
        self.grid1 = (b * hkv * g_blocks, num_splits)
        # fp32 math over an fp32 cache (dots in IEEE fp32, not tf32) and in the CPU interpreter (its
        # raw bf16 arithmetic is wrong). A 16-bit cache with a query of another dtype keeps its
        # tensor-core dots, q and the weights entering them in parts (see triton_decode).
        dot_bytes, dot_parts = dot_math(q.dtype, k.dtype)
        upcast = interpret or dot_bytes == 4
        # An fp8 cache's tiles widen to fp16: a bf16 or fp32 query enters the dots in fp16 parts,
        # prescaled into fp16's range, as over an fp16 cache (see triton_decode).
        dot_dtype = torch.float16 if self.fp8 else k.dtype
        mixed = q.dtype != dot_dtype and dot_bytes == 2
        if num_splits > 1:
            # The split partials: workspace owned by this launch, reused by every call (calls are
            # ordered on one stream; kernels.prepared keys its cache on the stream too).
            # [B, Sq * Hq, S, ...]: the (token, head) pairs are stage two's heads.
            self.o_part = torch.empty(b, sq * hq, num_splits, d, dtype=torch.float32, device=q.device)
            self.lse_part = torch.empty(b, sq * hq, num_splits, dtype=torch.float32, device=q.device)
        # With one split stage one writes the caller's out and lse directly.
        out_strides, lse_strides = self.out_layout.strides(sq, hq, d)  # (row, token, head)
        if num_splits == 1:
            o_strides = (*out_strides, 0)
            l_strides = (*lse_strides, 0)
        else:
            po, pl = self.o_part.stride(), self.lse_part.stride()
            o_strides = (po[0], hq * po[1], po[1], po[2])
            l_strides = (pl[0], hq * pl[1], pl[1], pl[2])
        q_strides = (q.stride(0), q.stride(1), q.stride(2)) if self.tokens else (q.stride(0), 0, q.stride(1))
        table_stride = block_table.stride(0) if block_table is not None else 0
        # Every runtime scalar argument after the seven pointers, in the kernel's order.
        self._stage1_scalars = (
            *q_strides, table_stride, shape.num_blocks,
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            *o_strides, *l_strides,
            hkv, g_blocks, n, split_len(n, num_splits, cfg.block_n), scale * LOG2E,
        )
        self._stage1_constexprs = dict(
            GROUP=shape.group,
            Q_LEN=sq,
            CAUSAL=bool(causal and sq > 1),  # one token sees all its row's keys either way
            PAGED=self.paged,
            PAGE_SIZE=max(1, shape.block_size),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_G=group_block(shape.query_rows),
            BLOCK_N=cfg.block_n,
            STRIDE_QD=q.stride(-1),
            STRIDE_KD=k.stride(3),
            STRIDE_VD=v.stride(3),
            HAS_SEQ_LENS=self.has_lens,
            UPCAST=upcast,
            MIXED=mixed,
            DOT_PARTS=dot_parts,
            Q_PRESCALE=mixed and dot_dtype == torch.float16,
            DOT_PRECISION="ieee",
            KV_FP8=self.fp8,
            # The V tile's widening as inline PTX (see triton_decode): e4m3 on NVIDIA, compiled code.
            FP8_PTX=self.fp8 and backend == "cuda" and not upcast,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if rocm and cfg.waves_per_eu is not None:
            self._stage1_constexprs["waves_per_eu"] = cfg.waves_per_eu
        if num_splits > 1:
            # Stage two sees Sq * Hq heads: a token's stride is Hq head strides in every layout.
            self._stage2_args = _stage2_args(
                self.o_part, self.lse_part, (out_strides[0], out_strides[2]), (lse_strides[0], lse_strides[2])
            )
            self._grid2 = (b * sq * hq,)
            self._stage2_constexprs = dict(
                HEAD_DIM=d,
                BLOCK_D=block_d,
                SPLIT_TILE=STAGE2_SPLIT_TILE,
                FAULTY_IS_EMPTY=False,  # a NaN split comes from NaN data: the row is NaN
                num_warps=STAGE2_NUM_WARPS,
            )
        self._guard = _device_guard(q.device)

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``out [B, (Sq,) Hq, D]`` and ``lse [B, (Sq,) Hq]`` float32 in this launch's :class:`OutLayout`."""
        s = self.shape
        return self.out_layout.new(s.batch, s.q_heads, s.head_dim, self.device, s.q_len if self.tokens else None)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, block_table: torch.Tensor | None = None,
        *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write the attention of ``q`` over ``k, v`` into ``out`` and ``lse`` (laid out as this
        launch's :class:`OutLayout`, e.g. from :meth:`new_outputs`). ``seq_lens`` and
        ``block_table`` must be contiguous int32 tensors (or None iff they were at construction);
        out-of-range lengths and block ids are clamped by the kernel. ``k_scale``/``v_scale``:
        an fp8 cache's scales, tensors like those at construction (None for other caches)."""
        if self.trivial:
            out.zero_()
            lse.fill_(float("-inf"))
            return
        try:
            with self._guard:
                for kernel, grid, args, kwargs in self.launches(
                    q, k, v, seq_lens, out, lse, block_table, k_scale=k_scale, v_scale=v_scale
                ):
                    kernel[grid](*args, **kwargs)
        except Exception as exc:  # re-raised unless it is Triton's resource error
            if type(exc).__name__ == "OutOfResources":
                hint = "use a smaller block_n or fewer num_stages"
                if q.dtype != k.dtype and not self.fp8:
                    hint += (f", or a query in the cache's dtype (q.to({k.dtype}): "
                             f"a {q.dtype} query enters the dots in parts)")
                raise ConfigError(
                    f"config {self.config.describe()} needs more shared memory or registers than {self.device} has "
                    f"for D={self.shape.head_dim}, {self.shape.query_rows} query rows per KV head, {k.dtype}: "
                    f"{hint} ({exc})"
                ) from exc
            raise

    def launches(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, block_table: torch.Tensor | None = None,
        *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> list[tuple]:
        """The kernel launches of one call, in order: ``(jit function, grid, args, keyword args)``
        (stage one; stage two when there are several splits). :meth:`__call__` runs them; an
        ahead-of-time compile passes them to ``JITFunction.run(..., warmup=True)``, so it builds
        exactly what a launch with these tensors would. Empty for a trivial launch."""
        if self.trivial:
            return []
        kernels = _kernels()  # lazy: triton is imported only when the kernel runs
        # Without seq_lens any tensor serves as the pointer: HAS_SEQ_LENS=False never reads it;
        # likewise the scales' pointers without an fp8 cache (KV_FP8=False).
        lens = seq_lens if self.has_lens else lse
        table = block_table if self.paged else lse
        if self.fp8:
            if k_scale is None or v_scale is None:
                raise ConfigError("this launch is for an fp8 cache: pass its k_scale and v_scale "
                                  "(float32 [Hkv]) at every call")
            scales = (k_scale, v_scale)
        else:
            scales = (lse, lse)
        if self.num_splits == 1:
            return [(kernels.split_kv_stage1_kernel, self.grid1,
                     (q, k, v, lens, table, *scales, out, lse, *self._stage1_scalars), self._stage1_constexprs)]
        return [
            (kernels.split_kv_stage1_kernel, self.grid1,
             (q, k, v, lens, table, *scales, self.o_part, self.lse_part, *self._stage1_scalars),
             self._stage1_constexprs),
            (kernels.split_kv_stage2_kernel, self._grid2,
             (self.o_part, self.lse_part, out, lse, *self._stage2_args), self._stage2_constexprs),
        ]


def _kernels():
    """The module of the two ``@triton.jit`` kernels, imported on first use (then a lookup)."""
    global _KERNELS
    if _KERNELS is None:
        from . import triton_decode

        _KERNELS = triton_decode
    return _KERNELS


_KERNELS = None


def decode_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, config: DecodeConfig | None = None,
    device_spec: DeviceSpec | None = None, block_table: torch.Tensor | None = None, causal: bool = False,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode attention with the Triton kernel, resolved afresh on every call (tests,
    tuning of one config). Decode loops use ``kernels.prepared``, which resolves once.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]`` fp16/bf16/fp32, any strides.
        k, v: ``[B, N, Hkv, D]`` (same dtype, any strides, e.g. slices of a larger cache), ``Hq % Hkv == 0``;
            with ``block_table``: pools ``[num_blocks, block_size, Hkv, D]``. fp16/bf16/fp32, or
            fp8 (``torch.float8_e4m3fn``; ``float8_e4m3fnuz`` on ROCm) with ``k_scale``/``v_scale``.
        seq_lens: optional integer ``[B]`` on q's device, valid keys per row (0..N; clamped to that range).
        scale, config, device_spec, block_table, causal, k_scale, v_scale: see :class:`TritonDecodeLaunch`.

    Returns:
        ``out`` in q's dtype and shape and ``lse`` float32 (``[B, (Sq,) Hq]``, natural log);
        query tokens without keys give out 0 and lse -inf.
    """
    launch = TritonDecodeLaunch(
        q, k, v, seq_lens, scale=scale, config=config, device_spec=device_spec, block_table=block_table, causal=causal,
        k_scale=k_scale, v_scale=v_scale,
    )
    out, lse = launch.new_outputs()
    lens = None if seq_lens is None else seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    table = None if block_table is None else block_table.to(device=q.device, dtype=torch.int32).contiguous()
    launch(q, k, v, lens, out, lse, table, k_scale=k_scale, v_scale=v_scale)
    return out, lse


# What an fp8 cache needs from the GPU: Triton's NVIDIA backend has e4m3 (fp8e4nv) from sm_89
# (Ada, Hopper: hardware conversions) and no "fnuz" variant; its AMD backend converts fnuz
# (fp8e4b8) in hardware on CDNA3 (gfx942) and e4m3 in software before CDNA4.
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def fp8_unsupported_reason(kv_dtype: torch.dtype, backend: str,
                           capability: tuple[int, int] | None = None) -> str | None:
    """Why the Triton kernel cannot take a ``kv_dtype`` (fp8) cache on ``backend`` ("cuda", "hip",
    "interpreter") with CUDA compute ``capability`` (None: not known), or None if it can."""
    if backend == "cuda":
        if kv_dtype == torch.float8_e4m3fnuz:
            return (
                "float8_e4m3fnuz (AMD's fp8 variant) caches run on ROCm GPUs only: on NVIDIA GPUs "
                "use torch.float8_e4m3fn"
            )
        if capability is not None and tuple(capability) < FP8_MIN_CUDA_CAPABILITY:
            return (
                f"fp8 KV caches need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
                f"{capability[0]}.{capability[1]}: use a bfloat16 or float16 cache on it"
            )
    return None


def _check_fp8_backend(kv_dtype: torch.dtype, backend: str, device: torch.device | None) -> None:
    capability = None
    if backend == "cuda" and device is not None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    reason = fp8_unsupported_reason(kv_dtype, backend, capability)
    if reason is not None:
        raise ConfigError(reason)


def _check_scales(fp8: bool, k: torch.Tensor, device: torch.device, kv_heads: int, k_scale, v_scale) -> None:
    """The launcher's checks of fp8 scales: present iff the cache is fp8, float32 ``[Hkv]``
    contiguous on q's device. Their values (finite, nonzero) are the caller's to check: that
    needs a host sync on GPUs (``decode_attention`` does it once per call site)."""
    given = (k_scale is not None, v_scale is not None)
    if not fp8:
        if any(given):
            raise ConfigError(f"k_scale/v_scale are for fp8 caches (torch.float8_e4m3fn); this cache is {k.dtype}")
        return
    if not all(given):
        raise ConfigError(f"an fp8 cache ({k.dtype}) needs both k_scale and v_scale: "
                          "float32 [Hkv] dequantization scales")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (kv_heads,):
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(f"{name} must be a float32 tensor [Hkv] = [{kv_heads}] for the Triton kernel; got {what}")
        if t.device != device:
            raise ConfigError(f"{name} must be on {device}; got {t.device}")
        if kv_heads > 1 and t.stride(0) != 1:
            raise ConfigError(f"{name} must be contiguous; got stride {t.stride(0)}")


def _check_tile_offsets(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int) -> None:
    """Inside one tile the kernel computes element offsets in int32 (the tile base is int64), which
    holds unless a cache's sequence stride is enormous (a time-major cache, say): reject that
    instead of reading the wrong addresses. Strides of 2^31 or more arrive as int64 and are safe."""
    for name, t in (("k", k), ("v", v)):
        stride_n, stride_d = t.stride(1), t.stride(3)
        if max(stride_n, stride_d) >= 2**31:
            continue
        reach = (block_n - 1) * stride_n + (block_d - 1) * stride_d
        if reach >= 2**31:
            raise ConfigError(
                f"{name}'s sequence stride ({stride_n:,} elements) is too large for {block_n}-key tiles: offsets "
                f"inside a tile must fit int32. Use a config with a smaller block_n (at most "
                f"{_max_block_n(stride_n, stride_d, block_d)}), or a cache laid out [B, N, Hkv, D]"
            )


def _max_block_n(stride_n: int, stride_d: int, block_d: int) -> int:
    room = (2**31 - 1 - (block_d - 1) * stride_d) // max(1, stride_n) + 1
    return 1 << max(0, room.bit_length() - 1)


def merge_splits_triton(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    faulty_is_empty: bool = True,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage two on its own: merge ``S`` partial states per (row, head) with the Triton kernel.

    Args:
        o_part: ``[B, H, S, D]`` partial outputs (any float dtype is read as stored; D stride 1 is
            required, other strides are free).
        lse_part: ``[B, H, S]`` natural-log LSEs, any strides; -inf marks an empty state.
        out_dtype: dtype of the merged out (default: o_part's).
        faulty_is_empty: True (the public ``merge_partials`` rule): a +inf or NaN lse is an
            empty state too. False (states of our own kernels): it makes the row NaN.
        out, lse: write into these (``[B, H, D]`` with D stride 1, ``[B, H]`` float32; any other
            strides, e.g. views of a packed message) instead of new tensors.

    Returns:
        ``out [B, H, D]`` and ``lse [B, H]`` float32, as ``tree_attn.reduce.state.merge_states``
        computes them (empty rows: out 0, lse -inf).
    """
    if o_part.dim() != 4 or lse_part.shape != o_part.shape[:3]:
        raise ConfigError(
            "merge_splits_triton wants o_part [B, H, S, D] and lse_part [B, H, S]; "
            f"got {tuple(o_part.shape)} and {tuple(lse_part.shape)}"
        )
    if o_part.stride(3) != 1:
        o_part = o_part.contiguous()
    lse_part = lse_part.float()
    b, h, s, d = o_part.shape
    if out is None:
        out = torch.empty(b, h, d, dtype=out_dtype or o_part.dtype, device=o_part.device)
    if lse is None:
        lse = torch.empty(b, h, dtype=torch.float32, device=o_part.device)
    if b * h == 0 or d == 0:
        return out, lse
    if s == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    with _device_guard(o_part.device):
        _launch_stage2(o_part, lse_part, out, lse, faulty_is_empty=faulty_is_empty)
    return out, lse


def _stage2_args(o_part: torch.Tensor, lse_part: torch.Tensor, out_strides, lse_strides) -> tuple:
    """Stage two's runtime scalars after its four pointers, in the kernel's order."""
    return (
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        *out_strides, *lse_strides,
        o_part.shape[1], o_part.shape[2],
    )


def _launch_stage2(
    o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, faulty_is_empty: bool
) -> None:
    """Merge the splits ``o_part [B, H, S, D]``, ``lse_part [B, H, S]`` into ``out [B, H, D]``,
    ``lse [B, H]``: one program per (row, head). D strides must be 1."""
    kernel, grid, args, kwargs = stage2_launch(o_part, lse_part, out, lse, faulty_is_empty=faulty_is_empty)
    kernel[grid](*args, **kwargs)


def stage2_launch(
    o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, faulty_is_empty: bool
) -> tuple:
    """Stage two's launch on these tensors as ``(jit function, grid, args, keyword args)`` (see
    :meth:`TritonDecodeLaunch.launches`): what :func:`merge_splits_triton` launches."""
    b, h, _s, d = o_part.shape
    args = (o_part, lse_part, out, lse,
            *_stage2_args(o_part, lse_part, (out.stride(0), out.stride(1)), (lse.stride(0), lse.stride(1))))
    kwargs = dict(
        HEAD_DIM=d,
        BLOCK_D=padded_head_dim(d),
        SPLIT_TILE=STAGE2_SPLIT_TILE,
        FAULTY_IS_EMPTY=faulty_is_empty,
        num_warps=STAGE2_NUM_WARPS,
    )
    return _kernels().split_kv_stage2_kernel, (b * h,), args, kwargs


class _DeviceGuard:
    """Make ``index`` the current CUDA device for a launch (Triton launches on the current device
    and stream), switching only when it is not already: ``torch.cuda.device`` always sets it and
    sets it back, a few microseconds of host time per launch for nothing in the usual case."""

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.previous = None

    def __enter__(self):
        if self.index is not None:
            current = torch.cuda.current_device()
            if current != self.index:
                self.previous = current
                torch.cuda.set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            torch.cuda.set_device(self.previous)
            self.previous = None
        return False


def _device_guard(device: torch.device) -> _DeviceGuard:
    if device.type != "cuda":
        return _DeviceGuard(None)
    return _DeviceGuard(device.index if device.index is not None else torch.cuda.current_device())
