"""Greedy tokens that part at a near-tie: when a row of ``generate`` may differ from the reference.

In float32 every row must give the reference's tokens exactly. In 16-bit, two correct
implementations of the same model round differently (another attention kernel, another order of
summation), and where the reference's two best logits lie within a few units in the last place
(ulps) of the logits' dtype, greedy decoding may pick either. From there the two continue from
different tokens and nothing later is comparable. Transformers itself does this: on one H100
(small preset, random weights, bf16, an 8K prompt) its sdpa on the GPU chose token 172 at step 9,
where its sdpa on the CPU, and every tree-attn row on the GPU, chose 2213; the reference's logits
for the two differed by 0.75 at 21.5, 6 bf16 ulps.

So the reference records each step's :data:`TOP_K` best logits, and a row that first parts from
it at step ``i`` passes as a *near-tie* when its token there is among those and the reference's
own logits for the two tokens differ by at most :data:`TIE_ULPS` ulps of the reference's best
logit. The row is reported as such (the step, both tokens, the gap in logits and in ulps), never as
"same". Anything else, a token outside the reference's best or a wider gap, is a difference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the CLI's setup reads TIE_ULPS without it
    import torch

__all__ = ["TIE_ULPS", "TOP_K", "NearTie", "StepTop", "near_tie", "parting", "step_top", "ulp"]

TOP_K = 8  # best logits the reference records per step
TIE_ULPS = 8  # the widest gap, in ulps of the logits' dtype at the best logit, that counts as a tie


@dataclass(frozen=True)
class StepTop:
    """One decode step's best logits (as float32 values of the model's logits), best first."""

    ids: tuple[int, ...]
    logits: tuple[float, ...]

    def logit_of(self, token: int) -> float | None:
        return self.logits[self.ids.index(token)] if token in self.ids else None


def step_top(logits: torch.Tensor, k: int = TOP_K) -> StepTop:
    """The ``k`` best of one step's logits ``[vocab]``."""
    import torch

    values, ids = torch.topk(logits.float(), min(k, logits.numel()))
    return StepTop(tuple(ids.tolist()), tuple(values.tolist()))


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at ``|x|`` (its unit in the last place there)."""
    import torch

    info = torch.finfo(dtype)
    x = max(abs(x), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(x))


@dataclass(frozen=True)
class NearTie:
    """Where a row first parts from the reference at a near-tie. ``step``: 0-based index of the
    generated token; ``gap``: the reference's best logit minus its logit for the row's token (both
    float32 values of ``dtype`` logits); ``ulps``: the gap in ulps of ``dtype`` at the best logit."""

    step: int
    token: int
    reference_token: int
    gap: float
    ulps: float
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"the same tokens up to token {self.step}; at token {self.step + 1} it chose {self.token}, the reference "
                f"{self.reference_token}, whose own logits for the two differ by {self.gap:.4g} ({self.ulps:.1f} ulps "
                f"of {self.dtype}, a tie within {TIE_ULPS}); after that the two continue from different tokens")


def near_tie(tokens: list[int], reference: list[int], top: list[StepTop], dtype: torch.dtype) -> NearTie | None:
    """The near-tie at which ``tokens`` first part from ``reference`` (the reference's ``top`` per
    step, its logits of ``dtype``), or None: the same tokens, a part beyond a tie, or no logits."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if step is None or step >= len(top) or len(tokens) != len(reference):
        return None
    mine, theirs = top[step].logit_of(tokens[step]), top[step].logit_of(reference[step])
    if mine is None or theirs is None:
        return None
    gap = theirs - mine
    ulps = gap / ulp(theirs, dtype)
    if ulps > TIE_ULPS:
        return None
    return NearTie(step, tokens[step], reference[step], gap, ulps, str(dtype).removeprefix("torch."))


def parting(tokens: list[int], reference: list[int], top: list[StepTop], dtype: torch.dtype) -> str | None:
    """Where and how far ``tokens`` part from ``reference`` (for an error), or None if they do not."""
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if step is None:
        return None if len(tokens) == len(reference) else f"{len(tokens)} tokens against the reference's {len(reference)}"
    where = f"token {step + 1}: {tokens[step]} against the reference's {reference[step]}"
    if step >= len(top):
        return where
    mine, theirs = top[step].logit_of(tokens[step]), top[step].logit_of(reference[step])
    if mine is None or theirs is None:
        return where + f" (not among the reference's {len(top[step].ids)} best logits there)"
    return where + (f" (the reference's logits for the two differ by {theirs - mine:.4g}, "
                    f"{(theirs - mine) / ulp(theirs, dtype):.1f} ulps of {str(dtype).removeprefix('torch.')}; "
                    f"a tie is within {TIE_ULPS})")
