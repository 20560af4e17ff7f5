"""Where a decode launch writes its outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutLayout:
    """Where a decode launch writes ``out [B, Hq, D]`` and ``lse [B, Hq]`` (or, for Sq query
    tokens per row, ``out [B, Sq, Hq, D]`` and ``lse [B, Sq, Hq]``); D stride 1 always.

    ``packed=False``: two contiguous tensors, out in ``out_dtype`` (what the public API returns).
    ``packed=True``: the views ``[..., :D]`` and ``[..., D]`` of one float32 ``[B, (Sq,) Hq, D + 1]``
    message, the state a reduction sends (``out_dtype`` is then float32).
    """

    out_dtype: torch.dtype = torch.float32
    packed: bool = False

    def strides(self, sq: int, hq: int, d: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(row, token, head) strides of out and of lse. In both layouts a token's stride is Hq
        head strides, so (token, head) also reads as one flat head index ``token * Hq + head``."""
        if self.packed:
            s = (sq * hq * (d + 1), hq * (d + 1), d + 1)
            return s, s
        return (sq * hq * d, hq * d, d), (sq * hq, hq, 1)

    def new(self, b: int, hq: int, d: int, device, sq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh tensors in this layout: ``[B, Hq, ...]``, or ``[B, Sq, Hq, ...]`` when ``sq`` is given."""
        lead = (b, hq) if sq is None else (b, sq, hq)
        if self.packed:
            buf = torch.empty(*lead, d + 1, dtype=torch.float32, device=device)
            return buf[..., :d], buf[..., d]
        return (torch.empty(*lead, d, dtype=self.out_dtype, device=device),
                torch.empty(*lead, dtype=torch.float32, device=device))


# The message a reduction sends, and separate float32 partials (the ring's per-block states).
PACKED = OutLayout(torch.float32, packed=True)
FLOAT32 = OutLayout(torch.float32)
