"""Local decode attention resolved once per shape signature (FlashInfer's plan/run split).

A decode loop calls the same shapes thousands of times. :class:`PreparedDecode` resolves what
depends only on the signature (input checks, the implementation, the Triton config and split
count, the grid, the split workspace, the launch's constant arguments) when it is built; calling
it only launches. :func:`prepared_decode` keeps a small cache of them keyed by the signature, which
``decode_attention`` and the collectives use, so their public contract is unchanged.

The signature is everything the resolution read: shapes, strides, dtypes, device (and on GPUs the
current stream, because the split workspace is reused call after call and calls on one stream are
ordered), whether ``seq_lens`` is given and its dtype, a paged cache's block table (shape, dtype,
strides; the pool's shape gives the block size), the query tokens per row (q's shape),
``causal``, ``scale``, ``impl``, ``config``, where the outputs go, and an fp8 cache's scales'
form (a Python number's value; a tensor's dtype, shape and device: see ``kernels.fp8``).

fp8 scales are checked (both given, floating, a scalar or ``[Hkv]``, on the cache's device) when
a prepared object is built, and their values (finite, positive) on every call for CPU tensors,
once at build for GPU tensors (one host sync; the kernels read the values at every call, so a
caller may update them in place, CUDA-graph replays included). A scalar is expanded to ``[Hkv]``
float32 before any kernel sees it.

Block-table values are checked (``kernels.paged.check_block_table``) on every call for CPU
tensors and, for GPU tensors, once when the prepared object is built (one host sync, never per
step; the kernel clamps block ids into the pool).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import partial
from typing import Any, NamedTuple

import torch

from ..errors import ConfigError
from ..graphs import CapturedStep, StaticStep, persistent_buffers
from .config import DecodeConfig
from .fp8 import PreparedScales, ScaleForm, check_fp8_backend, scale_form
from .impl import resolve_impl, triton_interpreter_enabled
from .layout import OutLayout
from .shapes import DecodeShape, check_arg_types, check_decode_inputs, check_seq_lens_range, resolve_scale

# Prepared objects kept per process: a decode loop uses one or two signatures (one per shard
# length and layer shape); the bound keeps a long-running server from growing without limit.
CACHE_SIZE = 64


class DecodeOptions(NamedTuple):
    """How a local decode call computes, apart from its tensors: what a prepared object is resolved
    from together with the tensors' metadata, and part of its cache key. A named tuple rather than
    a frozen dataclass: the public functions build and hash one on every call, and a tuple is
    cheap there (built, hashed and compared in ~0.4 us against ~1.3 us; measured on this 2-core
    EPYC VM). :meth:`checked` is its validation.

    Attributes:
        scale: softmax scale, default ``D ** -0.5``.
        impl: "auto" | "torch" | "triton".
        config: a ``DecodeConfig`` for the Triton kernel (ignored by torch).
        out_layout: where outputs go (default: contiguous out in q's dtype, lse float32); a packed
            layout writes the ``[B, Hq, D + 1]`` float32 message a reduction sends.
        causal: Sq new tokens are the row's last Sq valid keys; token i sees those ``<= i``.
    """

    scale: float | None = None
    impl: str = "auto"
    config: DecodeConfig | None = None
    out_layout: OutLayout | None = None
    causal: bool = False

    def checked(self) -> DecodeOptions:
        """These options with config and scale checked (before anything hashes them: a dict config
        would raise TypeError) and a tensor scale read by value (a fresh tensor each call would be
        a new signature every time). Cheap: no tensor data is read but a scale tensor's."""
        scale, config = self.scale, self.config
        _check_config(config)
        if scale is None or type(scale) is float:  # the usual case first: one call per decode step
            return self
        if isinstance(scale, torch.Tensor):
            return self._replace(scale=float(scale))
        _check_scale(scale)
        return self

    @classmethod
    def of(cls, options: DecodeOptions | None, fields: dict[str, Any]) -> DecodeOptions:
        """``options``, or options built from their fields given as keywords (not both), checked."""
        if options is None:
            return cls(**fields).checked()
        if fields:
            raise TypeError(f"give DecodeOptions or its fields as keywords, not both (got {', '.join(fields)} too)")
        return options.checked()


class PreparedDecode:
    """Decode attention of one signature: ``out, lse = prepared(q, k, v, seq_lens)``.

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]``; k, v: ``[B, N, Hkv, D]``, or with
            ``block_table [B, max_blocks]`` pools ``[num_blocks, block_size, Hkv, D]``; seq_lens:
            ``[B]`` integer or None (required when paged) (example tensors: later calls pass
            tensors of the same signature).
        block_table: int32 ``[B, max_blocks]`` for a paged cache (see ``kernels.paged``), or None.
        options: a :class:`DecodeOptions`, or its fields as keywords (``scale``, ``impl``,
            ``config``, ``out_layout``, ``causal``).
        check_values: check CPU tensors' ``seq_lens`` and block-table values on every call (True,
            as the public functions do), or only here, once (False: for a decode loop that owns
            them and keeps them in range, as ``generate``'s shard does; on GPUs they are checked
            once either way).
        k_scale, v_scale: an fp8 cache's dequantization scales (``kernels.fp8``): Python numbers,
            or float tensors ``()``/``[1]``/``[Hkv]`` on the cache's device (example tensors:
            later calls pass scales of the same form). None for other caches.

    CPU tensors that the C kernel takes run it through a :class:`~.cpu_native.NativeDecodePlan`
    resolved here: a call then only copies q and the lengths in and launches.
    """

    @persistent_buffers()
    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
        *, block_table: torch.Tensor | None = None, options: DecodeOptions | None = None, check_values: bool = True,
        k_scale=None, v_scale=None, **fields: Any,
    ) -> None:
        opts = self.options = DecodeOptions.of(options, fields)
        config, causal = opts.config, opts.causal
        self.impl = resolve_impl(opts.impl, q.device)
        self.shape: DecodeShape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        form = scale_form(k.dtype, k_scale, v_scale, self.shape.kv_heads, k.device)
        # Values of GPU scale tensors: checked here, once (never inside a CUDA-graph capture).
        self.scales = PreparedScales(form, k_scale, v_scale, self.shape.kv_heads, k.device, not _capturing(q))
        if self.scales.fp8 and self.impl == "triton":
            check_fp8_backend(k.dtype, q.device)
        self.causal = causal
        self.tokens = q.dim() == 4  # outputs [B, Sq, Hq, ...] rather than [B, Hq, ...]
        if self.shape.head_dim == 0:
            raise ConfigError("head dim D must be at least 1")
        self.scale = resolve_scale(opts.scale, self.shape.head_dim)
        self.out_layout = opts.out_layout or OutLayout(q.dtype)
        self.device = q.device
        # Value checks of seq_lens need its values on the host: only for CPU tensors (free there);
        # on GPUs the kernel clamps lengths to 0..N instead of syncing.
        # (check_decode_inputs above checked them once, for CPU tensors.)
        self._check_lens_values = check_values and seq_lens is not None and seq_lens.device.type == "cpu"
        # The kernel reads int32 lengths; other integer dtypes are converted per call.
        self._lens_cast = seq_lens is not None and (seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous())
        self._table_cast = block_table is not None and (
            block_table.dtype != torch.int32 or not block_table.is_contiguous())
        if block_table is not None and block_table.device.type != "cpu" and not _capturing(q):
            # Once per signature (a host sync here, none per step; none at all inside a CUDA-graph
            # capture, where a sync is illegal: the kernel clamps block ids to the pool either way).
            # CPU tables are checked per call.
            from .paged import check_block_table

            check_block_table(block_table, seq_lens, self.shape.num_blocks, self.shape.block_size)
        self._launch = None
        self._native = None
        if self.impl == "torch" and self.device.type == "cpu" and not self.scales.fp8:
            # The plan calls the C kernel without scales: an fp8 cache takes decode_attention_cpu's
            # path per call (its own fp8 widening in the C kernel, the scales folded in there).
            from .cpu_decode import native_plan

            self._native = native_plan(q, k, v, block_table, self.scale, causal)
        if self.impl == "triton":
            from .triton_launch import TritonDecodeLaunch  # lazy: triton only when it runs

            self._launch = TritonDecodeLaunch(
                q, k, v, seq_lens, scale=self.scale, config=config, out_layout=self.out_layout,
                block_table=block_table, causal=causal, **self._scale_kwargs(k_scale, v_scale),
            )

    def _scale_kwargs(self, k_scale, v_scale) -> dict:
        """The scales as the kernels take them: ``{}`` without fp8, else float32 ``[Hkv]`` tensors."""
        if not self.scales.fp8:
            return {}
        ks, vs = self.scales(k_scale, v_scale)
        return {"k_scale": ks, "v_scale": vs}

    @property
    def config(self) -> DecodeConfig | None:
        """The resolved Triton config (splits filled in); None on the torch path."""
        return self._launch.config if self._launch is not None else None

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``out``/``lse`` in this object's layout (``[B, (Sq,) Hq, D]``, ``[B, (Sq,) Hq]``)."""
        s = self.shape
        return self.out_layout.new(s.batch, s.q_heads, s.head_dim, self.device, s.q_len if self.tokens else None)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        *, k_scale=None, v_scale=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` over ``k, v`` (pages listed by ``block_table`` when paged; an fp8
        cache dequantized by ``k_scale``, ``v_scale``, of the form given at construction); into
        ``out``/``lse`` when given (in this object's layout), else into fresh tensors. Returns
        ``(out, lse)``."""
        if out is None or lse is None:
            out, lse = self.new_outputs()
        scales = self._scale_kwargs(k_scale, v_scale)
        if self._check_lens_values:
            check_seq_lens_range(seq_lens, self.shape.kv_len)
            if block_table is not None:
                from .paged import check_block_table

                check_block_table(block_table, seq_lens, self.shape.num_blocks, self.shape.block_size)
        if self._native is not None and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        ):
            self._native(q, k, v, seq_lens, block_table, out, lse)
            return out, lse
        if self._launch is None:
            from .reference import decode_attention_torch

            o, l = decode_attention_torch(
                q, k, v, seq_lens=seq_lens, scale=self.scale, block_table=block_table, causal=self.causal, **scales
            )
            out.copy_(o)
            lse.copy_(l)
            return out, lse
        if self._lens_cast:
            seq_lens = seq_lens.to(dtype=torch.int32).contiguous()
        if self._table_cast:
            block_table = block_table.to(dtype=torch.int32).contiguous()
        self._launch(q, k, v, seq_lens, out, lse, block_table, **scales)
        return out, lse


def _check_config(config) -> None:
    if config is not None and not isinstance(config, DecodeConfig):
        raise ConfigError(f"config must be a DecodeConfig or None; got {type(config).__name__}: {config!r}")


def _check_scale(scale) -> None:
    """A scale that is not a number at all (a string, a list) is a ConfigError, not float()'s
    ValueError, and so is a bool (``scale=True`` is not a softmax scale of 1); numbers (and
    tensors) are range-checked once per signature by PreparedDecode."""
    if isinstance(scale, bool):
        raise ConfigError(f"scale must be a finite number or None; got {scale!r}")
    if scale is None or isinstance(scale, (int, float, torch.Tensor)):
        return
    try:
        float(scale)
    except (TypeError, ValueError):
        raise ConfigError(f"scale must be a finite number or None; got {type(scale).__name__} {scale!r}") from None


def signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | None,
    block_table: torch.Tensor | None,
    options: DecodeOptions,
    scales: ScaleForm | None = None,
) -> tuple | None:
    """The cache key of a call: everything :class:`PreparedDecode` resolves from (cheap to build:
    tensor metadata only, no value read). Sq is q's shape and the block size the pool's; ``scales``
    an fp8 cache's scale form (:func:`kernels.fp8.scale_form`). None inside a CUDA-graph capture:
    nothing is cached there (see :func:`prepared_decode`)."""
    lens = None if seq_lens is None else (seq_lens.dtype, seq_lens.device, tuple(seq_lens.shape), seq_lens.stride())
    table = None if block_table is None else (
        block_table.dtype, block_table.device, tuple(block_table.shape), block_table.stride()
    )
    if q.is_cuda:  # (not q.device.type: that costs ~0.5 us of host time per read)
        if torch.cuda.is_current_stream_capturing():
            return None
        where = torch.cuda.current_stream(q.device).cuda_stream
    else:  # CPU tensors: whether Triton's interpreter is on decides what impl="triton" does
        where = triton_interpreter_enabled()
    # The thread too: a prepared object's split workspace serves one call at a time, and two
    # threads on one stream could interleave their two launches.
    return (
        q.shape, q.stride(), q.dtype, q.device,
        k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device,
        lens, table, options, scales, where, threading.get_ident(),
    )


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


_CACHE: OrderedDict[tuple, PreparedDecode] = OrderedDict()


def prepared_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
    *, block_table: torch.Tensor | None = None, options: DecodeOptions | None = None,
    k_scale=None, v_scale=None, **fields: Any,
) -> PreparedDecode:
    """The cached :class:`PreparedDecode` for this call's signature (built on first use), with
    :class:`PreparedDecode`'s arguments.

    Inside a CUDA-graph capture a fresh, uncached one is built: its workspace is then allocated
    from the graph's private memory pool and lives as long as the graph, where a cached one's
    could be evicted (freed, reused) while the graph still writes to it. (Capturing a loop is
    what :class:`DecodeStep` does for you.)
    """
    opts = options.checked() if options is not None and not fields else DecodeOptions.of(options, fields)
    check_arg_types(q, k, v, seq_lens, block_table, opts.causal)  # before the key reads their attributes
    # The scales' form is checked on every call (cheap: no value read); values per prepared object.
    form = scale_form(k.dtype, k_scale, v_scale, k.shape[2], k.device) if k.dim() == 4 else None
    key = signature(q, k, v, seq_lens, block_table, opts, form)  # None: capturing
    hit = None if key is None else _CACHE.get(key)
    if hit is None:
        hit = PreparedDecode(q, k, v, seq_lens, block_table=block_table, options=opts, k_scale=k_scale, v_scale=v_scale)
        if key is not None:
            _CACHE[key] = hit
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        return hit
    try:
        _CACHE.move_to_end(key)
    except KeyError:  # another thread evicted it meanwhile: it still serves this call
        pass
    return hit


def clear_cache() -> None:
    """Drop every cached prepared object (and the GPU workspace they hold)."""
    _CACHE.clear()


class DecodeStep(StaticStep):
    """Local decode attention on static tensors, replayed as a CUDA graph on GPUs.

    For decode loops and serving engines that keep static buffers: build it once from the
    tensors the loop updates in place (``q [B, Hq, D]`` or ``[B, Sq, Hq, D]``; ``k, v [B, N, Hkv, D]``
    the cache, N its capacity, or paged pools with ``block_table [B, max_blocks]``, whose contents
    may change between steps; ``seq_lens [B]`` the valid lengths), then ``out, lse = step()`` each
    step. A GPU block table is checked once, here; later contents are not (a graph replay cannot
    sync), and the kernel clamps block ids into the pool. On GPUs a
    step is one graph replay (the kernel's one or two launches); on CPU it runs eagerly. ``out``
    (q's dtype) and ``lse`` (float32) are static: overwritten by the next step. ``captured``
    says whether the graph is in use, ``why_eager`` why not. ``check_values=False``: CPU
    lengths and block-table values are checked here only, not per step (see :class:`PreparedDecode`).

    An fp8 cache takes ``k_scale``, ``v_scale`` (``decode_attention``'s): numbers, fixed, or
    tensors read at every step (update them in place; GPU values are checked once, here).
    """

    @persistent_buffers()
    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
        *, scale: float | None = None, impl: str = "auto", config: DecodeConfig | None = None,
        cuda_graph: bool = True, block_table: torch.Tensor | None = None, causal: bool = False,
        check_values: bool = True, k_scale=None, v_scale=None,
    ) -> None:
        self.tensors = (q, k, v, seq_lens)
        self.block_table = block_table
        self.prepared = PreparedDecode(q, k, v, seq_lens, block_table=block_table, check_values=check_values,
                                       options=DecodeOptions(scale, impl, config, causal=causal),
                                       k_scale=k_scale, v_scale=v_scale)
        self.scales = (k_scale, v_scale)
        self.out, self.lse = self.prepared.new_outputs()
        # The graph's function holds the step's parts, not the step: a bound method would make a
        # cycle (step -> graph -> step), and the graph would outlive `del step` until the
        # garbage collector ran.
        self.graph = CapturedStep(
            partial(_decode_step, self.prepared, self.tensors, self.out, self.lse, self.block_table, self.scales),
            q.device, enabled=cuda_graph, name="the local decode step",
        )

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.graph()


def _decode_step(prepared: PreparedDecode, tensors: tuple, out: torch.Tensor, lse: torch.Tensor,
                 block_table: torch.Tensor | None, scales: tuple = (None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """One :class:`DecodeStep` on its static tensors (what its graph captures)."""
    return prepared(*tensors, out, lse, block_table, k_scale=scales[0], v_scale=scales[1])
