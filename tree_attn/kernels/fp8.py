"""fp8 KV caches: the format, the quantize helper, and the checks of dequantization scales.

An fp8 cache stores K and V as ``torch.float8_e4m3fn`` (OCP e4m3: 1 sign, 4 exponent bits of
bias 7, 3 mantissa bits; largest finite value 448, no infinity, NaN at 0x7F/0xFF), or AMD CDNA3's
``torch.float8_e4m3fnuz`` (bias 8, largest 240, NaN at 0x80 only, no -0), with float32
dequantization scales ``k_scale``, ``v_scale``: a scalar, or one per KV head ``[Hkv]``. The
cache's value at KV head h is ``stored.float() * scale[h]``, exactly (the product of a 4-bit
significand and a float32 has at most 28 bits; float32 rounds it, float64 holds it). That is
the convention of vLLM's and FlashInfer's ``k_scale``/``v_scale``.

Where the scales go in each kernel (nothing is dequantized in memory):

- Triton (GPUs): ``k_scale`` is folded into the softmax scale, ``v_scale`` into the output, per KV
  head (``kernels.triton_decode``);
- the C kernel (CPU ranks): the same folding, into the float32 query rows of each KV head and into
  the output (``kernels.cpu_native``);
- the torch ops (CPU fallback; GPUs with ``impl="torch"``): each chunk widened to float32 and
  multiplied by its head's scale, ``k.float() * k_scale[h]`` (``kernels.reference``).

:func:`quantize_kv` makes such a cache from a float one (per KV head, ``amax / 448``).
:func:`scale_form` checks the scales a call passes (once per prepared signature: see
``kernels.prepared``) and :func:`expand_scales` makes the ``[Hkv]`` float32 tensors the kernels take.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple

import torch

from ..errors import ConfigError, KernelUnavailableError
from .shapes import FP8_DTYPES

# The fp8 formats a cache may use (shapes.FP8_DTYPES), and their largest finite values (e4m3:
# 1.75 x 2^8; e4m3fnuz, bias 8: 1.875 x 2^7). Both dtypes exist from torch 2.1 (this project needs
# 2.3); whether a build converts them on CPU is check_fp8_support's question.
E4M3, E4M3_FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8_MAX: dict[torch.dtype, float] = {E4M3: 448.0, E4M3_FNUZ: 240.0}

# Elements of K (or V) converted to float32 at a time by quantize_kv: bounds its extra memory
# (16 MiB of float32) whatever the cache's size.
QUANTIZE_CHUNK_ELEMENTS = 1 << 22


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an fp8 cache dtype."""
    return dtype in FP8_DTYPES


@functools.cache
def _conversion_error(dtype: torch.dtype) -> str | None:
    try:
        x = torch.tensor([1.5, -0.25], dtype=torch.float32)
        back = x.to(dtype).float()
    except (RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if torch.equal(back, x) else f"1.5, -0.25 came back as {back.tolist()}"


def check_fp8_support(dtype: torch.dtype | None = None) -> None:
    """Raise :class:`KernelUnavailableError` if this torch cannot convert ``dtype`` (default
    ``float8_e4m3fn``) on CPU: builds before 2.1 have no fp8 dtypes, and some builds lack their
    CPU conversions. Checked once per process."""
    if dtype is None:
        dtype = E4M3
    why = _conversion_error(dtype)
    if why is not None:
        raise KernelUnavailableError(
            f"this torch ({torch.__version__}) cannot convert {dtype} on CPU ({why}): fp8 KV caches need a build "
            "with fp8 CPU conversions (torch 2.1 or newer); upgrade torch, or keep the cache in bfloat16 or float16"
        )


def _check_fp8_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_MAX:
        raise ConfigError(f"dtype must be an fp8 dtype ({', '.join(str(t) for t in FP8_DTYPES)}); got {dtype!r}")
    check_fp8_support(dtype)
    return dtype


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., Hkv, D]`` as ``[R, Hkv, D]`` (a view when x's leading dims flatten)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _chunks(x: torch.Tensor):
    rows = _rows(x)
    per = max(1, QUANTIZE_CHUNK_ELEMENTS // max(1, rows.shape[1] * rows.shape[2]))
    for r0 in range(0, rows.shape[0], per):
        yield r0, rows[r0 : r0 + per]


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest finite ``|x|`` per KV head of ``x [..., Hkv, D]`` (float32 ``[Hkv]`` on x's device;
    NaN and infinities are left out: they become NaN codes of the cache, which no scale can
    represent; an all-zero or empty head gives 0). Reads x chunk by chunk."""
    hkv = x.shape[-2]
    amax = torch.zeros(hkv, dtype=torch.float32, device=x.device)
    for _, c in _chunks(x):
        a = c.float().abs()  # out of place: .float() of a float32 tensor is the tensor itself
        a = torch.where(torch.isfinite(a), a, 0.0)
        amax = torch.maximum(amax, a.amax(dim=(0, 2)) if a.shape[0] else amax)
    return amax


def scales_for(amax: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """Dequantization scales from per-head maxima: ``amax / FP8_MAX[dtype]``, and 1 for a head whose
    maximum is 0 (an all-zero head: any scale stores it exactly; 1 keeps it finite and nonzero, as
    the kernels require)."""
    top = FP8_MAX[_check_fp8_dtype(dtype)]
    return torch.where(amax > 0, amax.float() / top, torch.ones_like(amax, dtype=torch.float32)).contiguous()


def quantize(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., Hkv, D]`` stored as fp8 with the given scales ``[Hkv]``: ``x / scale[h]`` rounded to
    nearest (even), saturated at the format's largest finite value (a value beyond it, e.g. a new
    token larger than the prefill's maximum, is stored as that maximum, never NaN); NaN and
    infinities become NaN. Into ``out`` (same shape, fp8) when given. Chunked: extra memory is
    bounded."""
    dtype = _check_fp8_dtype(dtype)
    top = FP8_MAX[dtype]
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != dtype or not out.is_contiguous():
        raise ConfigError(f"quantize: out must be a contiguous {dtype} tensor of x's shape {tuple(x.shape)}; got "
                          f"{out.dtype} {tuple(out.shape)}")
    dst = _rows(out)  # a view: out is contiguous
    inv = (1.0 / scale.to(device=x.device, dtype=torch.float32)).view(1, -1, 1)
    for r0, c in _chunks(x):
        y = c.float() * inv
        finite = torch.isfinite(y)
        y = torch.where(finite, y.clamp_(-top, top), float("nan"))
        dst[r0 : r0 + c.shape[0]].copy_(y.to(dtype))
    return out


def quantize_kv(
    k: torch.Tensor, v: torch.Tensor, *, dtype: torch.dtype = E4M3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a KV cache to fp8 with one float32 scale per KV head: ``k8, v8, k_scale, v_scale``.

    Args:
        k, v: ``[..., Hkv, D]`` float32/float16/bfloat16 (a contiguous cache ``[B, N, Hkv, D]``, a
            paged pool ``[num_blocks, block_size, Hkv, D]``, ...), on any device.
        dtype: ``torch.float8_e4m3fn`` (default; max 448) or ``torch.float8_e4m3fnuz`` (AMD
            MI300's format; max 240).

    Returns:
        ``k8, v8`` fp8, k and v's shapes, contiguous; ``k_scale, v_scale`` float32 ``[Hkv]`` on
        their device: per KV head, the largest finite ``|value|`` over the whole cache divided by
        the format's largest value (448), so that the head's largest value is stored as +-448; a
        head that is all zeros gets scale 1 (it is stored exactly either way). NaN and infinities
        are stored as NaN. Pass them on: ``decode_attention(q, k8, v8, k_scale=k_scale,
        v_scale=v_scale)``; ``k8.float() * k_scale[h]`` is the cache the kernels attend over.
    """
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.dtype.is_floating_point or is_fp8(t.dtype):
            what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(f"quantize_kv: {name} must be a float32/float16/bfloat16 tensor [..., Hkv, D]; "
                              f"got {what}")
    if k.shape[-2] != v.shape[-2]:
        raise ConfigError(f"quantize_kv: k and v must have the same KV heads; got k {tuple(k.shape)}, "
                          f"v {tuple(v.shape)}")
    dtype = _check_fp8_dtype(dtype)
    k_scale, v_scale = scales_for(head_amax(k), dtype), scales_for(head_amax(v), dtype)
    return quantize(k, k_scale, dtype), quantize(v, v_scale, dtype), k_scale, v_scale


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x8 [..., Hkv, D]`` (fp8) as ``dtype``: ``x8.to(dtype) * scale[h]`` (exact in float64)."""
    return x8.to(dtype) * scale.to(device=x8.device, dtype=dtype)[:, None]


# -- where fp8 runs on GPUs ------------------------------------------------------------------------

# DECISION POINT (AMD): the fp8 formats the Triton kernel takes on ROCm GPUs. MI300 (gfx942, CDNA3)
# converts float8_e4m3fnuz in hardware, and the kernel supports it there. float8_e4m3fn compiles on
# ROCm too but is converted in software before CDNA4, which nobody has measured: refused until it is
# (widen this tuple to allow it).
ROCM_FP8_DTYPES: tuple[torch.dtype, ...] = (E4M3_FNUZ,)


def check_fp8_backend(kv_dtype: torch.dtype, device: torch.device) -> None:
    """Raise :class:`ConfigError` if the Triton kernel cannot take a ``kv_dtype`` cache on ``device``
    (nothing to check for CPU tensors: Triton's interpreter decodes both formats). NVIDIA GPUs need
    compute capability 8.9 (Ada, Hopper: Triton has no e4m3 below it, so no software widening on
    sm_80) and ``float8_e4m3fn``; ROCm GPUs take :data:`ROCM_FP8_DTYPES`."""
    if device.type != "cuda":
        return
    from .device_info import is_rocm

    if is_rocm():
        if kv_dtype not in ROCM_FP8_DTYPES:
            raise ConfigError(
                f"{kv_dtype} caches are not supported on ROCm GPUs (converted in software there, unmeasured): use "
                "torch.float8_e4m3fnuz, MI300's hardware fp8 "
                "(tree_attn.quantize_kv(k, v, dtype=torch.float8_e4m3fnuz)), "
                "or a bfloat16 cache"
            )
        return
    from .triton_launch import fp8_unsupported_reason  # no triton import at module level

    reason = fp8_unsupported_reason(kv_dtype, "cuda", torch.cuda.get_device_capability(device))
    if reason is not None:
        raise ConfigError(reason)


# -- the scales a call passes ----------------------------------------------------------------------


class ScaleForm(NamedTuple):
    """What a call's ``k_scale``/``v_scale`` are, without their values (part of a prepared
    signature): None for a cache that is not fp8; else per scale either ``("value", x)`` (a Python
    number: its value, fixed) or ``("tensor", dtype, shape, device)``."""

    k: tuple | None
    v: tuple | None


NO_SCALES = ScaleForm(None, None)


def _form(name: str, s: Any, kv_heads: int, device: torch.device) -> tuple:
    if isinstance(s, bool):
        raise ConfigError(f"{name} must be a positive finite number or a float32 tensor (a scalar or [Hkv]); got {s!r}")
    if isinstance(s, numbers.Real):  # Python and NumPy numbers
        check_scale_values(name, torch.tensor([float(s)], dtype=torch.float64))
        return ("value", float(s))
    if not isinstance(s, torch.Tensor):
        raise ConfigError(f"{name} must be a positive finite number or a float32 tensor (a scalar or [Hkv]); got "
                          f"{type(s).__name__}")
    if not s.dtype.is_floating_point or is_fp8(s.dtype):
        raise ConfigError(f"{name} must be a float32 tensor (float16, bfloat16 and float64 are converted); "
                          f"got {s.dtype}")
    if tuple(s.shape) not in ((), (1,), (kv_heads,)):
        raise ConfigError(f"{name} must be a scalar or one scale per KV head [Hkv] = [{kv_heads}]; got shape "
                          f"{tuple(s.shape)}")
    if s.device != device:
        raise ConfigError(f"{name} must be on the cache's device {device}; got {s.device}")
    return ("tensor", s.dtype, tuple(s.shape), s.device)


def scale_form(kv_dtype: torch.dtype, k_scale: Any, v_scale: Any, kv_heads: int, device: torch.device) -> ScaleForm:
    """Check a call's scales against its cache (no value read for tensors): an fp8 cache needs
    both, any other cache neither; each a positive finite Python number, or a floating tensor
    (converted to float32) of shape ``()``, ``[1]`` or ``[Hkv]`` on the cache's device. Raises
    :class:`ConfigError`; returns the scales' :class:`ScaleForm`."""
    fp8 = is_fp8(kv_dtype)
    if not fp8:
        if (k_scale is not None or v_scale is not None) and kv_dtype.is_floating_point and kv_dtype.itemsize == 1:
            raise ConfigError(f"fp8 caches must be {', '.join(str(t) for t in FP8_DTYPES)}; this cache is {kv_dtype}: "
                              "quantize the float cache with tree_attn.quantize_kv")
        if k_scale is not None or v_scale is not None:
            raise ConfigError(f"k_scale/v_scale dequantize fp8 caches (torch.float8_e4m3fn); this cache is {kv_dtype}: "
                              "drop the scales, or pass the cache in fp8 (tree_attn.quantize_kv)")
        return NO_SCALES
    if k_scale is None or v_scale is None:
        missing = " and ".join(n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is None)
        raise ConfigError(f"an fp8 cache ({kv_dtype}) needs its dequantization scales: pass {missing} (a scalar or "
                          "float32 [Hkv]; tree_attn.quantize_kv returns them)")
    check_fp8_support(kv_dtype)
    return ScaleForm(_form("k_scale", k_scale, kv_heads, device), _form("v_scale", v_scale, kv_heads, device))


def check_scale_values(name: str, s: torch.Tensor) -> None:
    """Raise :class:`ConfigError` unless every value of ``s`` is finite and positive as the kernels
    read it, in float32 (a float64 scale beyond float32's range becomes inf there, one below its
    smallest subnormal 0). Reads the values: a host sync for GPU tensors."""
    as32 = s if s.dtype == torch.float32 else s.to(torch.float32)
    bad = (~(torch.isfinite(as32) & (as32 > 0))).reshape(-1)
    if bool(bad.any()):
        value = float(as32.reshape(-1)[bad][0])
        given = float(s.reshape(-1)[bad][0])
        what = ("a NaN" if math.isnan(value) else "a zero" if value == 0 else "an infinite" if math.isinf(value)
                else "a negative")
        # A value that is fine as given but not in float32: say both.
        shown = f"{given:g}, which is {value} in float32" if math.isfinite(given) and given > 0 else f"{given}"
        raise ConfigError(f"{name} must be positive and finite in float32 (a dequantization scale: the cache's "
                          f"amax / 448); got {what} value ({shown})")


def expand_scale(s: Any, kv_heads: int, device: torch.device) -> torch.Tensor:
    """One scale as the float32 ``[Hkv]`` contiguous tensor the kernels take (a view or ``s``
    itself when it already is one; a scalar expanded)."""
    if not isinstance(s, torch.Tensor):
        return torch.full((kv_heads,), float(s), dtype=torch.float32, device=device)
    if s.dtype == torch.float32 and s.dim() == 1 and s.shape[0] == kv_heads and s.is_contiguous():
        # The usual form, at every call of a decode step: no torch op (.to and .contiguous cost
        # ~3 us each of host time even when they return s itself).
        return s
    s = s.to(torch.float32)
    if s.dim() == 0 or s.shape[0] != kv_heads:
        s = s.reshape(1).expand(kv_heads)
    return s.contiguous()


class PreparedScales:
    """A signature's scales resolved once: Python-number scales made into constant ``[Hkv]``
    float32 tensors here; tensor scales converted at each call (free when they are float32
    ``[Hkv]`` contiguous). ``check_values``: check tensor values at each call (CPU tensors: free);
    otherwise they were checked once, at construction, outside any CUDA-graph capture."""

    def __init__(self, form: ScaleForm, k_scale, v_scale, kv_heads: int, device: torch.device, check_now: bool) -> None:
        self.form = form
        self.kv_heads = kv_heads
        self.device = device
        self.fp8 = form.k is not None
        self._const = tuple(expand_scale(s, kv_heads, device) if f is not None and f[0] == "value" else None
                            for f, s in ((form.k, k_scale), (form.v, v_scale)))
        self.check_values = self.fp8 and device.type == "cpu"
        if self.fp8 and check_now and not self.check_values:
            for name, f, s in (("k_scale", form.k, k_scale), ("v_scale", form.v, v_scale)):
                if f[0] == "tensor":
                    check_scale_values(name, s)

    def __call__(self, k_scale, v_scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The call's scales as float32 ``[Hkv]`` tensors (None, None for a cache that is not fp8)."""
        if not self.fp8:
            return None, None
        out = []
        for name, const, s in (("k_scale", self._const[0], k_scale), ("v_scale", self._const[1], v_scale)):
            if const is not None:
                out.append(const)
                continue
            if not isinstance(s, torch.Tensor):
                raise ConfigError(f"{name}: this prepared call was built for a tensor scale; got {type(s).__name__}")
            if self.check_values:
                check_scale_values(name, s)
            out.append(expand_scale(s, self.kv_heads, self.device))
        return out[0], out[1]
