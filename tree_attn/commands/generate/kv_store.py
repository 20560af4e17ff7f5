"""One rank's shard of a model's KV cache, paged as serving engines page it.

Every layer has a K pool and a V pool ``[num_blocks, page_size, Hkv, D]``; the shard's tokens
are mapped to pages by one block table ``[1, num_blocks]`` (int32) shared by the layers, a
shuffled permutation so that logical and physical order differ as in a real engine.
``seq_lens [1]`` (int32) holds the shard's valid tokens, the same for every layer.

An fp8 shard (``dtype=torch.float8_e4m3fn``) stores K and V quantized as they are written, with
one float32 scale per layer and KV head for K and for V (``k_scale[l]``, ``v_scale[l]``,
``[Hkv]``). The scales are fixed once per layer: by :meth:`PagedKVShard.set_scales` (e.g. from the
whole prompt, so that every rank uses the same), or else from the layer's first write (the
prefill): amax / 448 per head. Later tokens are quantized with those scales, saturating at +-448
times the scale (a value beyond the prefill's largest is clipped, never NaN): what an engine that
fixes its scales at prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from ...kernels.fp8 import head_amax, is_fp8, quantize, scales_for
from ...kernels.paged import check_block_size
from .setup import PAGE_SIZE


@dataclass
class PagedKVShard:
    """A rank's paged KV for ``layers`` layers with room for ``capacity`` tokens.

    ``k[l]``, ``v[l]``: layer l's pools ``[num_blocks, page_size, Hkv, D]``; ``block_table``
    ``[1, num_blocks]`` int32; ``seq_lens`` ``[1]`` int32; ``length``: the same count as an int.
    fp8 pools: ``k_scale[l]``, ``v_scale[l]`` float32 ``[Hkv]`` once layer l's scales are fixed
    (None before); empty lists for other dtypes.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    length: int = 0
    k_scale: list[torch.Tensor | None] = field(default_factory=list)
    v_scale: list[torch.Tensor | None] = field(default_factory=list)

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
        unset = [None] * layers if is_fp8(dtype) else []
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            block_table=table.to(device),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
            page_size=page_size,
            k_scale=list(unset),
            v_scale=list(unset),
        )

    @property
    def fp8(self) -> bool:
        return is_fp8(self.k[0].dtype) if self.k else False

    def set_scales(self, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Fix layer ``layer``'s dequantization scales (float32 ``[Hkv]``, positive) before its
        first write (an fp8 shard only)."""
        if not self.fp8:
            raise ConfigError(f"scales belong to fp8 KV pools; these are {self.k[layer].dtype}")
        dev = self.k[layer].device
        self.k_scale[layer] = k_scale.to(device=dev, dtype=torch.float32).contiguous()
        self.v_scale[layer] = v_scale.to(device=dev, dtype=torch.float32).contiguous()

    def scales(self, layer: int) -> dict:
        """Layer ``layer``'s scales as the decode functions' keywords (``{}`` unless fp8)."""
        if not self.fp8:
            return {}
        if self.k_scale[layer] is None:
            raise ConfigError(f"layer {layer} of this fp8 KV shard has no scales yet: write its prefill (or "
                              "set_scales) first")
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (and an fp8 shard's scales)."""
        scales = [t for t in (*self.k_scale, *self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *scales))

    def check_room(self, start: int, n: int) -> None:
        """Raise :class:`ConfigError` unless tokens ``start .. start + n - 1`` fit in the shard."""
        if start + n > self.capacity:
            raise ConfigError(f"KV shard full: {start + n} tokens asked for, room for {self.capacity}")

    def slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets in the page) of the token ``positions`` (int64, on the shard's
        device), computed on the device: no host sync, so a CUDA graph can hold it. Positions must
        be inside the shard (:meth:`check_room`); the page index is clamped into the table so that
        a position past it could never index outside it on a GPU."""
        pages = (positions // self.page_size).clamp_(max=self.block_table.shape[1] - 1)
        return self.block_table[0, pages].long(), positions % self.page_size

    def _slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of tokens ``start .. start + n - 1``."""
        self.check_room(start, n)
        return self.slots(torch.arange(start, start + n, device=self.block_table.device))

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``k, v [n, Hkv, D]`` of ``layer`` at positions ``start ..`` (an fp8 shard:
        quantized with the layer's scales, fixed from this write if it is the layer's first)."""
        self.write_slots(layer, *self._slots(start, k.shape[0]), k, v)

    def write_slots(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Write tokens ``k, v [n, Hkv, D]`` of ``layer`` at the slots ``(blocks, offsets)`` (of
        :meth:`slots`): the one place KV enters the pools, a decode step's new token included (an
        fp8 shard quantizes here; its scales are fixed by the layer's first write)."""
        if self.fp8:
            dtype = self.k[layer].dtype
            if self.k_scale[layer] is None:
                self.set_scales(layer, scales_for(head_amax(k), dtype), scales_for(head_amax(v), dtype))
            k = quantize(k, self.k_scale[layer], dtype)
            v = quantize(v, self.v_scale[layer], dtype)
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
