"""The paged KV-cache layout serving engines use, and its checks.

A pool ``[num_blocks, block_size, Hkv, D]`` holds K (another one V); a block table
``[B, max_blocks]`` (int32) lists each row's pages in order: row b's token t lives at
``pool[block_table[b, t // block_size], t % block_size]``. Only the first
``ceil(seq_lens[b] / block_size)`` entries of a row are read; later entries may hold anything
(-1, 0, stale ids). Rows may share pages (prefix sharing) and pages may sit anywhere in the pool.

Block sizes 1..256 are accepted (vLLM uses 16, FlashInfer any size, FlashAttention multiples of
256): the Triton kernel computes each key's page and offset, so no size needs to be a power of two
or a multiple of its tile.

Where the block table's values are checked (reading them needs them on the host):

- CPU tensors: on every call (free there), by :func:`check_block_table`;
- GPU tensors: once, when the prepared object for a signature is built (the first
  ``decode_attention`` call of a signature, a ``DecodeStep``/``TreeDecodeStep`` constructor): one
  host sync then, none per step. Later tables on the GPU are not checked (a CUDA-graph step must
  not sync); the kernel clamps every block id into the pool, so a bad id reads a wrong page of
  this pool, never memory outside it. Call :func:`check_block_table` yourself to check one.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, ShapeError

# The block sizes the kernels take. 256 is FlashAttention's page size; above that a page is longer
# than any key tile (512 at most), which the kernel could take, but no engine uses such pages and
# the bound keeps the per-key index arithmetic in the tested range.
MIN_BLOCK_SIZE = 1
MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int) -> None:
    """Raise :class:`ConfigError` unless ``MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE``."""
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(
            f"paged KV: block size {block_size} (the pool's dim 1) is outside {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}; "
            f"use a pool [num_blocks, block_size, Hkv, D] with block_size in that range (vLLM uses 16)"
        )


def needed_blocks(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pages each row reads: ``ceil(seq_lens / block_size)`` (int64, on seq_lens' device)."""
    return (seq_lens.to(torch.int64) + block_size - 1) // block_size


def check_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise :class:`ShapeError` if an entry that a row reads lies outside ``0..num_blocks-1``.

    The message names the first bad (row, block index, value). Entries past a row's last needed
    block are not checked (they are never read). Reads the values: a host sync for GPU tensors
    (see the module docstring for when this runs).
    """
    if block_table.numel() == 0:
        return
    max_blocks = block_table.shape[1]
    used = torch.arange(max_blocks, device=block_table.device)[None, :] < needed_blocks(seq_lens, block_size)[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        value = int(block_table[row, col])
        raise ShapeError(
            f"block_table[{row}, {col}] = {value} points outside the pool of {num_blocks} blocks "
            f"(row {row} has seq_len {int(seq_lens[row])}, so it reads its first "
            f"{int(needed_blocks(seq_lens[row:row + 1], block_size)[0])} entries); every entry a row reads must be "
            f"in 0..{num_blocks - 1}"
        )


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The rows of a paged cache as a contiguous cache ``[B, max_blocks * block_size, Hkv, D]``.

    Args:
        pool: ``[num_blocks, block_size, Hkv, D]``.
        block_table: integer ``[B, max_blocks]``.
        seq_lens: integer ``[B]``, valid tokens per row (0..max_blocks * block_size).

    Returns:
        A new contiguous tensor in pool's dtype and device: row b's token t at ``[b, t]`` for
        ``t < ceil(seq_lens[b] / block_size) * block_size``; pages a row does not read are zeros
        (whatever their table entries hold). No host sync: unread entries are replaced before
        indexing, read entries are clamped into the pool (check them with
        :func:`check_block_table`).
    """
    nb, bs, hkv, d = pool.shape
    b, mb = block_table.shape
    if nb == 0 or b * mb == 0:
        return pool.new_zeros(b, mb * bs, hkv, d)
    needed = needed_blocks(seq_lens, bs).to(block_table.device)
    used = torch.arange(mb, device=block_table.device)[None, :] < needed[:, None]
    idx = torch.where(used, block_table.to(torch.int64), 0).clamp_(0, nb - 1)
    pages = pool[idx.to(pool.device)]  # [B, max_blocks, bs, Hkv, D]
    pages = torch.where(used.to(pool.device)[:, :, None, None, None], pages, pages.new_zeros(()))
    return pages.reshape(b, mb * bs, hkv, d)
