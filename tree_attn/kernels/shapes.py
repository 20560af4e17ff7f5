"""Validation of decode-attention inputs, shared by every implementation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, ShapeError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp8 caches (with dequantization scales): OCP e4m3, and AMD CDNA3's e4m3 "fnuz" variant.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)

# Query tokens per row: 1 to 16, the range the feature request for speculative decoding's verify
# step names (a linear draft checked in one call; tree-shaped drafts need a tree mask, which the
# causal mask here is not). The Triton kernel folds them into its query-row tile (Sq x the GQA
# group rows, in blocks of at most 64 rows per program, see kernels.config.group_block).
MAX_QUERY_TOKENS = 16


@dataclass(frozen=True)
class DecodeShape:
    """The sizes of one decode-attention call.

    batch B, query heads Hq, KV heads Hkv (Hq % Hkv == 0), head dim D, KV length N (padded: with
    a paged cache, the block table's capacity ``max_blocks * block_size``), query tokens per row
    Sq (1 for a ``[B, Hq, D]`` query), and for a paged cache its ``block_size`` and ``num_blocks``
    (both 0 for a contiguous cache).
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_len: int
    q_len: int = 1
    block_size: int = 0
    num_blocks: int = 0

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.q_heads // self.kv_heads

    @property
    def query_rows(self) -> int:
        """Query rows that read one KV head: ``Sq * group`` (the Triton kernel folds the Sq query
        tokens into its row tile, as it folds a GQA group, so K/V are read once for all of them)."""
        return self.q_len * self.group

    @property
    def paged(self) -> bool:
        return self.block_size > 0


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale of a call: ``scale`` as a float, default ``D ** -0.5``; a ConfigError
    unless it is finite."""
    value = head_dim**-0.5 if scale is None else float(scale)
    if not math.isfinite(value):
        raise ConfigError(f"scale must be a finite number; got {value}")
    return value


def check_arg_types(q, k, v, seq_lens, block_table=None, causal=False) -> None:
    """Raise :class:`ShapeError` unless q, k, v are tensors, seq_lens and block_table tensors or
    None, and causal a bool (cheap: run on every call, before anything reads their attributes)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if seq_lens is not None and not isinstance(seq_lens, torch.Tensor):
        raise ShapeError(f"seq_lens must be an integer torch.Tensor [B] or None; got {type(seq_lens).__name__}")
    if block_table is not None and not isinstance(block_table, torch.Tensor):
        raise ShapeError("block_table must be an int32 torch.Tensor [B, max_blocks] or None; "
                         f"got {type(block_table).__name__}")
    if not isinstance(causal, bool):
        raise ConfigError(f"causal must be True or False; got {type(causal).__name__} {causal!r}")


def check_decode_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    *,
    fp8_kv: bool = False,
) -> DecodeShape:
    """Check shapes, dtypes and devices of a decode call; return its sizes.

    ``q [B, Hq, D]`` or ``[B, Sq, Hq, D]``; contiguous KV ``k, v [B, N, Hkv, D]`` with optional
    ``seq_lens [B]``, or (with ``block_table [B, max_blocks]``) paged KV pools
    ``k, v [num_blocks, block_size, Hkv, D]`` with ``seq_lens`` required. For CPU tensors the
    values of seq_lens (0..N) and of the block table (every entry a row reads inside the pool) are
    checked too (free there; see ``kernels.paged`` for GPU tensors).

    ``fp8_kv``: K/V may also be fp8 (:data:`FP8_DTYPES`; the caller checks their scales).

    Raises :class:`ShapeError` naming the offending tensor and its shape, :class:`ConfigError`
    for a block size the kernels cannot take.
    """
    check_arg_types(q, k, v, seq_lens, block_table, causal)
    if q.dim() not in (3, 4):
        raise ShapeError(f"q must be [B, Hq, D] or [B, Sq, Hq, D]; got shape {tuple(q.shape)}")
    paged = block_table is not None
    kv_form = "pools [num_blocks, block_size, Hkv, D]" if paged else "[B, N, Hkv, D]"
    if k.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"k and v must be {kv_form}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ShapeError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dim() == 4:
        b, sq, hq, d = q.shape
        if not 1 <= sq <= MAX_QUERY_TOKENS:
            raise ShapeError(
                f"q [B, Sq, Hq, D] must have 1..{MAX_QUERY_TOKENS} query tokens per row; "
                f"got Sq={sq} (shape {tuple(q.shape)})"
            )
    else:
        (b, hq, d), sq = q.shape, 1
    _, n_or_bs, hkv, dk = k.shape
    block_size = num_blocks = 0
    if paged:
        from .paged import check_block_size

        num_blocks, block_size = k.shape[0], n_or_bs
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ShapeError(f"block_table must be [B, max_blocks] = [{b}, max_blocks]; "
                             f"got shape {tuple(block_table.shape)}")
        if block_table.dtype not in (torch.int32, torch.int64):
            raise ShapeError(f"block_table must be an int32 tensor; got {block_table.dtype}")
        if block_table.device != q.device:
            raise ShapeError(f"block_table must be on {q.device}; got {block_table.device}")
        if seq_lens is None:
            raise ShapeError("a paged KV cache (block_table given) needs seq_lens [B]: the valid tokens of each row")
        check_block_size(block_size)
        n = block_table.shape[1] * block_size
    else:
        if k.shape[0] != b:
            raise ShapeError(f"batch mismatch: q has B={b}, k/v have B={k.shape[0]}")
        n = n_or_bs
    if dk != d:
        raise ShapeError(f"head dim mismatch: q has D={d}, k/v have D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ShapeError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES and not (fp8_kv and name != "q" and t.dtype in FP8_DTYPES):
            kinds = ("float16, bfloat16, float32 or fp8 (float8_e4m3fn)" if fp8_kv and name != "q"
                     else "float16, bfloat16 or float32")
            raise ShapeError(f"{name} must be {kinds}; got {t.dtype}")
    if k.dtype != v.dtype:
        raise ShapeError(f"k and v must share a dtype; got k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if seq_lens is not None:
        if seq_lens.dim() != 1 or seq_lens.shape[0] != b:
            raise ShapeError(f"seq_lens must be [B]=[{b}]; got shape {tuple(seq_lens.shape)}")
        if seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex or seq_lens.dtype == torch.bool:
            raise ShapeError(f"seq_lens must be an integer tensor; got {seq_lens.dtype}")
        if seq_lens.device != q.device:
            raise ShapeError(f"seq_lens must be on {q.device}; got {seq_lens.device}")
        if seq_lens.device.type == "cpu":
            check_seq_lens_range(seq_lens, n)
            if paged:
                from .paged import check_block_table

                check_block_table(block_table, seq_lens, num_blocks, block_size)
    return DecodeShape(
        batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=n, q_len=sq, block_size=block_size, num_blocks=num_blocks
    )


def check_seq_lens_range(seq_lens: torch.Tensor, n: int) -> None:
    """Raise :class:`ShapeError` unless every value of ``seq_lens`` (a CPU tensor) lies in 0..n
    (n: the KV length, or a paged cache's block-table capacity)."""
    if seq_lens.numel() > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > n:
            raise ShapeError(f"seq_lens must lie in 0..N={n}; got values from {lo} to {hi}")
