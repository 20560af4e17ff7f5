"""One rank's shard of a model's KV cache, paged as serving engines page it.

Every layer has a K pool and a V pool ``[num_blocks, page_size, Hkv, D]``; the shard's tokens
are mapped to pages by one block table ``[1, num_blocks]`` (int32) shared by the layers, a
shuffled permutation so that logical and physical order differ as in a real engine.
``seq_lens [1]`` (int32) holds the shard's valid tokens, the same for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ...kernels.paged import check_block_size
from .setup import PAGE_SIZE


@dataclass
class PagedKVShard:
    """A rank's paged KV for ``layers`` layers with room for ``capacity`` tokens.

    ``k[l]``, ``v[l]``: layer l's pools ``[num_blocks, page_size, Hkv, D]``; ``block_table``
    ``[1, num_blocks]`` int32; ``seq_lens`` ``[1]`` int32; ``length``: the same count as an int.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    length: int = 0

    @classmethod
    def allocate(cls, layers: int, capacity: int, kv_heads: int, head_dim: int, *, dtype, device,
                 page_size: int = PAGE_SIZE, seed: int = 0) -> PagedKVShard:
        check_block_size(page_size)
        if capacity < 0:
            raise ConfigError(f"KV capacity must be >= 0; got {capacity}")
        blocks = max(1, -(-capacity // page_size))
        gen = torch.Generator().manual_seed(seed)
        table = torch.randperm(blocks, generator=gen).to(torch.int32).view(1, blocks)
        shape = (blocks, page_size, kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            block_table=table.to(device),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
            page_size=page_size,
        )

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def _slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of tokens ``start .. start + n - 1``."""
        if start + n > self.capacity:
            raise ConfigError(f"KV shard full: {start + n} tokens asked for, room for {self.capacity}")
        pos = torch.arange(start, start + n, device=self.block_table.device)
        return self.block_table[0, pos // self.page_size].long(), pos % self.page_size

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``k, v [n, Hkv, D]`` of ``layer`` at positions ``start ..``."""
        blocks, offsets = self._slots(start, k.shape[0])
        self.k[layer][blocks, offsets] = k.to(self.k[layer].dtype)
        self.v[layer][blocks, offsets] = v.to(self.v[layer].dtype)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid tokens of ``layer`` in order, ``[length, Hkv, D]`` each (a copy)."""
        blocks, offsets = self._slots(0, self.length)
        return self.k[layer][blocks, offsets], self.v[layer][blocks, offsets]

    def set_length(self, n: int) -> None:
        """Make ``n`` tokens valid (all layers): after writing them, or to drop later ones."""
        if not 0 <= n <= self.capacity:
            raise ConfigError(f"KV shard length {n} outside 0..{self.capacity}")
        self.length = n
        self.seq_lens.fill_(n)
