"""Where a decode launch writes its outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutLayout:
    """Where a decode launch writes ``out [B, Hq, D]`` and ``lse [B, Hq]`` (D stride 1 always).

    ``packed=False``: two contiguous tensors, out in ``out_dtype`` (what the public API returns).
    ``packed=True``: the views ``[..., :D]`` and ``[..., D]`` of one float32 ``[B, Hq, D + 1]``
    message, the state a reduction sends (``out_dtype`` is then float32).
    """

    out_dtype: torch.dtype = torch.float32
    packed: bool = False

    def strides(self, hq: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(row, head) strides of out and of lse."""
        if self.packed:
            return (hq * (d + 1), d + 1), (hq * (d + 1), d + 1)
        return (hq * d, d), (hq, 1)

    def new(self, b: int, hq: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh tensors in this layout."""
        if self.packed:
            buf = torch.empty(b, hq, d + 1, dtype=torch.float32, device=device)
            return buf[..., :d], buf[..., d]
        return (torch.empty(b, hq, d, dtype=self.out_dtype, device=device),
                torch.empty(b, hq, dtype=torch.float32, device=device))


# The message a reduction sends, and separate float32 partials (the ring's per-block states).
PACKED = OutLayout(torch.float32, packed=True)
FLOAT32 = OutLayout(torch.float32)
