"""Host side of the Triton split-KV decode kernel: validation, config, buffers, grids, launches.

Imported lazily by ``dispatch.decode_attention`` (and by tests/benchmarks), so that triton is only
needed when the Triton path actually runs.
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import ConfigError, KernelUnavailableError
from .config import DecodeConfig, group_block, group_blocks_for, padded_head_dim, resolve_config, split_len
from .device_info import device_spec_for, is_rocm
from .perf_model import STAGE2_SPLIT_TILE, DeviceSpec
from .shapes import check_decode_inputs

# Stage two is a small reduction ([S, D] fp32 per program); 4 warps cover D=256 in one pass.
STAGE2_NUM_WARPS = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    config: DecodeConfig | None = None,
    device_spec: DeviceSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode attention with the Triton kernel.

    Args:
        q: ``[B, Hq, D]`` fp16/bf16/fp32, any strides.
        k, v: ``[B, N, Hkv, D]`` (same dtype, any strides, e.g. slices of a larger cache), ``Hq % Hkv == 0``.
        seq_lens: optional integer ``[B]`` on q's device, valid keys per row (0..N; clamped to that range).
        scale: softmax scale, default ``D ** -0.5``.
        config: a :class:`DecodeConfig`; ``None`` = :func:`config.default_config`, and a config
            with ``num_splits=None`` gets the split heuristic.
        device_spec: override the device facts the heuristic uses (default: read from q's device).

    Returns:
        ``out [B, Hq, D]`` in q's dtype and ``lse [B, Hq]`` float32 (natural log); rows without
        keys give out 0 and lse -inf.
    """
    shape = check_decode_inputs(q, k, v, seq_lens)
    b, hq, hkv, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    if scale is None:
        scale = d**-0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ConfigError(f"scale must be a finite number; got {scale}")
    spec = device_spec if device_spec is not None else device_spec_for(q.device)
    cfg = resolve_config(config, shape, k.dtype, spec)
    rocm = q.device.type == "cuda" and is_rocm()
    if cfg.waves_per_eu is not None and not rocm and not _interpreting():
        raise ConfigError(
            f"DecodeConfig.waves_per_eu={cfg.waves_per_eu} is an AMD (ROCm) option; set it to None on this device ({q.device})"
        )

    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if n == 0:
        # No keys anywhere: the empty state, without a launch (a zero-length K has no storage to point at).
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if d == 0:
        raise ConfigError("head dim D must be at least 1")

    num_splits = cfg.num_splits
    assert num_splits is not None  # resolve_config fills it
    s_len = split_len(n, num_splits, cfg.block_n)
    block_g = group_block(shape.group)
    g_blocks = group_blocks_for(shape.group)
    block_d = padded_head_dim(d)

    _check_tile_offsets(k, v, cfg.block_n, block_d)

    interpret = _interpreting()
    if q.device.type != "cuda" and not interpret:
        raise KernelUnavailableError(
            f"the Triton decode kernel needs CUDA or ROCm tensors; these are on {q.device}. "
            "Use tree_attn.decode_attention(..., impl='torch'), or set TRITON_INTERPRET=1 before importing triton."
        )
    # fp32 math when the inputs are fp32 (dots in IEEE fp32, not tf32), when q and K differ in dtype
    # (tl.dot wants one operand type), and in the CPU interpreter (its raw bf16 arithmetic is wrong).
    upcast = interpret or k.dtype == torch.float32 or q.dtype != k.dtype

    if seq_lens is not None:
        lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
        has_lens = True
    else:
        lens = lse  # never read (HAS_SEQ_LENS=False); any tensor serves as the pointer
        has_lens = False

    if num_splits == 1:
        # One split: stage one writes the final out (in q's dtype) and lse directly.
        o_part, lse_part = out, lse
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        o_part = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
        o_strides = o_part.stride()[:3]
        l_strides = lse_part.stride()

    from . import triton_decode  # lazy: triton is imported only when the kernel runs

    launch_opts: dict = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if rocm and cfg.waves_per_eu is not None:
        launch_opts["waves_per_eu"] = cfg.waves_per_eu

    grid1 = (b * hkv * g_blocks, num_splits)
    try:
        with _device_guard(q.device):
            triton_decode.split_kv_stage1_kernel[grid1](
                q, k, v, lens, o_part, lse_part,
                q.stride(0), q.stride(1),
                k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2),
                o_strides[0], o_strides[1], o_strides[2],
                l_strides[0], l_strides[1], l_strides[2],
                hkv, g_blocks, n, s_len, scale * triton_decode.LOG2E,
                GROUP=shape.group,
                HEAD_DIM=d,
                BLOCK_D=block_d,
                BLOCK_G=block_g,
                BLOCK_N=cfg.block_n,
                STRIDE_QD=q.stride(2),
                STRIDE_KD=k.stride(3),
                STRIDE_VD=v.stride(3),
                HAS_SEQ_LENS=has_lens,
                UPCAST=upcast,
                DOT_PRECISION="ieee",
                **launch_opts,
            )
            if num_splits > 1:
                _launch_stage2(o_part, lse_part, out, lse)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is Triton's resource error
        if type(exc).__name__ == "OutOfResources":
            raise ConfigError(
                f"config {cfg.describe()} needs more shared memory or registers than {q.device} has "
                f"for D={d}, {k.dtype}: use a smaller block_n or fewer num_stages ({exc})"
            ) from exc
        raise
    return out, lse


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
    o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage two on its own: merge ``S`` partial states per (row, head) with the Triton kernel.

    Args:
        o_part: ``[B, H, S, D]`` partial outputs (any float dtype is read as stored; D stride 1 is
            required, other strides are free).
        lse_part: ``[B, H, S]`` natural-log LSEs; -inf, +inf or NaN mark an empty state.
        out_dtype: dtype of the merged out (default: o_part's).

    Returns:
        ``out [B, H, D]`` and ``lse [B, H]`` float32, as ``tree_attn.merge.merge_partials`` computes
        them (empty rows: out 0, lse -inf).
    """
    if o_part.dim() != 4 or lse_part.shape != o_part.shape[:3]:
        raise ConfigError(
            f"merge_splits_triton wants o_part [B, H, S, D] and lse_part [B, H, S]; got {tuple(o_part.shape)} and {tuple(lse_part.shape)}"
        )
    if o_part.stride(3) != 1:
        o_part = o_part.contiguous()
    lse_part = lse_part.float()
    b, h, s, d = o_part.shape
    out = torch.zeros(b, h, d, dtype=out_dtype or o_part.dtype, device=o_part.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float32, device=o_part.device)
    if b * h == 0 or s == 0 or d == 0:
        return out, lse
    with _device_guard(o_part.device):
        _launch_stage2(o_part, lse_part, out, lse)
    return out, lse


def _launch_stage2(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the splits ``o_part [B, H, S, D]``, ``lse_part [B, H, S]`` into ``out [B, H, D]``,
    ``lse [B, H]``: one program per (row, head). D strides must be 1."""
    from . import triton_decode

    b, h, s, d = o_part.shape
    triton_decode.split_kv_stage2_kernel[(b * h,)](
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1),
        h, s,
        HEAD_DIM=d,
        BLOCK_D=padded_head_dim(d),
        SPLIT_TILE=STAGE2_SPLIT_TILE,
        num_warps=STAGE2_NUM_WARPS,
    )


class _NullGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device and stream: make it q's device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _NullGuard()
