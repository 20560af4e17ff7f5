"""Greedy tokens that part at a near-tie: when a row of ``generate`` may differ from the reference.

In float32 every row must give the reference's tokens exactly. In 16-bit, two correct
implementations of the same model round differently (another attention kernel, another order of
summation), and where the reference's two best logits lie within a few units in the last place
(ulps) of the logits' dtype, greedy decoding may pick either. From there the two continue from
different tokens and nothing later is comparable. Transformers itself does this: on one H100
(small preset, random weights, bf16, an 8K prompt) its sdpa on the GPU chose token 172 at step 9,
where its sdpa on the CPU, and every tree-attn row on the GPU, chose 2213; the reference's logits
for the two differed by 0.75 at 21.5, 6 bf16 ulps.

So every row records each step's :data:`TOP_K` best logits (the reference in its process, a
strategy on its rank 0, after each token's timed span), and a row that first parts from the
yardstick (the reference, else the one-rank row, else the first row) at step ``i`` passes as a
*near-tie* when its token there is among the yardstick's best and the yardstick's own logits for
the two tokens differ by at most :data:`TIE_ULPS` ulps of the yardstick's logit for its own token.
The row is reported as such (the step, both tokens, the gap in logits and in ulps), never as
"same". Anything else, a token outside the yardstick's best or a wider gap, is a difference.
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
    """Where a row first parts from its yardstick (the row named ``against``) at a near-tie.
    ``step``: 0-based index of the generated token; ``their_token``: the yardstick's there; ``gap``:
    the yardstick's logit for its token minus its logit for the row's (float32 values of ``dtype``
    logits); ``ulps``: the gap in ulps of ``dtype`` at the yardstick's logit."""

    step: int
    token: int
    their_token: int
    gap: float
    ulps: float
    dtype: str
    against: str = "reference"

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"the same tokens up to token {self.step}; at token {self.step + 1} it chose {self.token}, the "
                f"{self.against} {self.their_token}, whose own logits for the two differ by {self.gap:.4g} "
                f"({self.ulps:.1f} ulps of {self.dtype}, a tie within {TIE_ULPS}); after that the two continue "
                f"from different tokens")


def _parting_step(tokens: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), None)


def near_tie(tokens: list[int], theirs: list[int], top: list[StepTop], dtype: torch.dtype,
             against: str = "reference") -> NearTie | None:
    """The near-tie at which ``tokens`` first part from ``theirs`` (the yardstick row ``against``,
    its ``top`` per step, logits of ``dtype``), or None: the same tokens, a parting beyond a tie,
    or no logits recorded."""
    step = _parting_step(tokens, theirs)
    if step is None or step >= len(top) or len(tokens) != len(theirs):
        return None
    mine, their = top[step].logit_of(tokens[step]), top[step].logit_of(theirs[step])
    if mine is None or their is None:
        return None
    gap = their - mine
    ulps = gap / ulp(their, dtype)
    if ulps > TIE_ULPS:
        return None
    return NearTie(step, tokens[step], theirs[step], gap, ulps, str(dtype).removeprefix("torch."), against)


def parting(tokens: list[int], theirs: list[int], top: list[StepTop], dtype: torch.dtype,
            against: str = "reference") -> str | None:
    """Where and how far ``tokens`` part from ``theirs`` (the yardstick row ``against``; for an
    error), or None if they do not."""
    step = _parting_step(tokens, theirs)
    if step is None:
        return None if len(tokens) == len(theirs) else f"{len(tokens)} tokens against the {against}'s {len(theirs)}"
    where = f"token {step + 1}: {tokens[step]} against the {against}'s {theirs[step]}"
    if step >= len(top):
        return where + f" (no logits of the {against} recorded there)"
    mine, their = top[step].logit_of(tokens[step]), top[step].logit_of(theirs[step])
    if mine is None or their is None:
        return where + f" (not among the {against}'s {len(top[step].ids)} best logits there)"
    return where + (f" (the {against}'s logits for the two differ by {their - mine:.4g}, "
                    f"{(their - mine) / ulp(their, dtype):.1f} ulps of {str(dtype).removeprefix('torch.')}; "
                    f"a tie is within {TIE_ULPS})")
