"""Greedy tokens that part at a near-tie: when a row of ``generate`` may differ from the row it is
checked against.

Two correct implementations of the same model round differently (another attention kernel,
another order of summation), and where the best two logits lie within a few units in the last
place (ulps) of the logits' dtype, greedy decoding may take either. From there the two continue
from different tokens and nothing later is comparable. Transformers itself does this: on one H100
(small preset, random weights, bf16, an 8K prompt) its sdpa on the GPU took token 172 at the 9th
step, where its sdpa on the CPU, and every tree-attn row on the GPU, took 2213; the reference's
logits for the two differed by 0.75 at 21.5, 6 bf16 ulps. On the CPU in bf16 (2K-4K prompts,
4-16 layers, the one-rank row against transformers) the two rows' logits differed by up to 9 ulps
before they parted, and half the runs parted within 16 tokens.

The two rows' logits drift apart with depth: on the CPU in bf16 (the one-rank row against
transformers, random weights, ``benchmarks/logit_agreement.py``) by up to 5 ulps with 4 layers, 9
with 16 and 27 with 32 before they parted. So the bound is :func:`tie_bound`: ``8 x sqrt(layers)``
ulps (16 at 4 layers, 32 at 16, 45 at 32).

Every row records each step's :data:`TOP_K` best logits (the reference in its process, a strategy
on each rank, after each token's timed span), and a row that first parts from its yardstick (the
reference, else the one-rank row, else the first row) at step ``i`` passes as a *near-tie* only
if, all within the bound:

- the yardstick's own logits for its token and the row's differ by at most that (the row's token
  is among the yardstick's best);
- the row's own logits for the two differ by at most that (where the row recorded its logits);
- at every step up to and including ``i`` (the same inputs until then) the two rows' logits for
  the tokens both recorded agree within that.

The row is reported as such (the step, both tokens, the gaps), never as "same". Anything else is a
difference. In float32 the bound is a few millionths of the logit: in effect exact.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the CLI reads the bound's scale without it
    import torch

__all__ = ["TIE_ULPS_PER_ROOT_LAYER", "TOP_K", "NearTie", "StepTop", "agreement_ulps", "near_tie", "parting",
           "step_top", "tie_bound", "ulp"]

TOP_K = 8  # best logits every row records per step
TIE_ULPS_PER_ROOT_LAYER = 8  # the bound's scale: tie_bound


def tie_bound(layers: int) -> float:
    """The widest gap, or disagreement, in ulps of the logits' dtype that counts as rounding in a
    model of ``layers`` layers: ``8 x sqrt(layers)``."""
    return TIE_ULPS_PER_ROOT_LAYER * math.sqrt(max(1, layers))


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
    """The spacing of ``dtype``'s values at ``|x|`` (its unit in the last place there); ``x`` finite."""
    import torch

    info = torch.finfo(dtype)
    x = max(abs(x), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(x))


def _ulps(a: float, b: float, dtype: torch.dtype) -> float:
    """``|a - b|`` in ulps of ``dtype`` at the larger of the two (inf unless both are finite)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / ulp(max(abs(a), abs(b)), dtype)


@dataclass(frozen=True)
class NearTie:
    """Where a row first parts from its yardstick (the row named ``against``) at a near-tie.
    ``step``: 0-based index of the generated token; ``their_token``: the yardstick's there;
    ``gap``: the yardstick's logit for its token minus its logit for the row's (float32 values of
    ``dtype`` logits), ``ulps`` that in ulps of ``dtype``; ``own_ulps``: the same gap in the row's
    own logits (None: the row recorded none); ``agree_ulps``: the largest difference between the
    two rows' logits for a token both recorded, at any step up to the parting (None: as own);
    ``bound``: the tie's bound in ulps (:func:`tie_bound`)."""

    step: int
    token: int
    their_token: int
    gap: float
    ulps: float
    dtype: str
    against: str = "reference"
    own_ulps: float | None = None
    agree_ulps: float | None = None
    bound: float = 16.0

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        before = "at the first token" if self.step == 0 else \
            f"the same tokens up to token {self.step}; at token {self.step + 1}"
        own = "" if self.own_ulps is None else \
            (f", in its own {self.own_ulps:.1f}; the two rows' logits agreed within {self.agree_ulps:.1f} ulps up to "
             "there")
        return (f"{before} it took {self.token}, the {self.against} {self.their_token}: the {self.against}'s logits "
                f"for the two differ by {self.gap:.4g} ({self.ulps:.1f} ulps of {self.dtype}){own}; ties within "
                f"{self.bound:.0f} ulps count as rounding; after that the two continue from different tokens")


def agreement_ulps(top: list[StepTop], other: list[StepTop], steps: int, dtype: torch.dtype) -> float:
    """The largest difference, in ulps of ``dtype``, between two rows' logits for a token both
    recorded among their best, over their first ``steps`` steps."""
    return max((_ulps(value, theirs, dtype)
                for s in range(steps)
                for token, value in zip(top[s].ids, top[s].logits, strict=True)
                if (theirs := other[s].logit_of(token)) is not None), default=0.0)


def _assess(tokens: list[int], theirs: list[int], top: list[StepTop], dtype: torch.dtype, against: str,
            own_top: list[StepTop] | None, bound: float) -> tuple[int | None, NearTie | None, str]:
    """``(parting step or None, the near-tie or None, why not a tie)`` for ``tokens`` against
    ``theirs`` (the yardstick's tokens, ``top`` its logits per step; ``own_top``: the row's), ties
    within ``bound`` ulps."""
    dt = str(dtype).removeprefix("torch.")
    step = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), None)
    if step is None:
        return None, None, "" if len(tokens) == len(theirs) else f"{len(tokens)} tokens against {len(theirs)}"
    if len(tokens) != len(theirs):
        return step, None, f"{len(tokens)} tokens against {len(theirs)}"
    if step >= len(top):
        return step, None, f"no logits of the {against} recorded there"
    mine, their = top[step].logit_of(tokens[step]), top[step].logit_of(theirs[step])
    if mine is None or their is None:
        return step, None, f"not among the {against}'s {len(top[step].ids)} best logits there"
    gap = their - mine
    ulps = _ulps(their, mine, dtype)
    if not gap >= 0 or ulps > bound:  # a negative gap would mean the record is not the argmax's
        return step, None, f"the {against}'s logits for the two differ by {gap:.4g}, {ulps:.1f} ulps of {dt}"
    own_ulps = agree = None
    if own_top:
        if step >= len(own_top):
            return step, None, "no logits of this row recorded there"
        mine_own, their_own = own_top[step].logit_of(tokens[step]), own_top[step].logit_of(theirs[step])
        if mine_own is None or their_own is None or not mine_own >= their_own:
            return step, None, f"the {against}'s token is not among this row's best logits there"
        own_ulps = _ulps(mine_own, their_own, dtype)
        if own_ulps > bound:
            return step, None, f"this row's own logits for the two differ by {own_ulps:.1f} ulps of {dt}"
        agree = agreement_ulps(top, own_top, step + 1, dtype)
        if agree > bound:
            return step, None, f"the two rows' logits differ by up to {agree:.1f} ulps of {dt} by then"
    return step, NearTie(step, tokens[step], theirs[step], gap, ulps, dt, against, own_ulps, agree, bound), ""


def near_tie(tokens: list[int], theirs: list[int], top: list[StepTop], dtype: torch.dtype, *, layers: int,
             against: str = "reference", own_top: list[StepTop] | None = None) -> NearTie | None:
    """The near-tie at which ``tokens`` (with the row's own logits ``own_top``, if recorded)
    first part from ``theirs`` (the yardstick row ``against``, its ``top`` per step, logits of
    ``dtype`` from a model of ``layers`` layers), or None: the same tokens, or a parting that is
    not a near-tie."""
    return _assess(tokens, theirs, top, dtype, against, own_top, tie_bound(layers))[1]


def parting(tokens: list[int], theirs: list[int], top: list[StepTop], dtype: torch.dtype, *, layers: int,
            against: str = "reference", own_top: list[StepTop] | None = None) -> str | None:
    """Where ``tokens`` part from ``theirs`` and why that is not a near-tie (for an error), or None
    if they do not part. Arguments as :func:`near_tie`'s."""
    bound = tie_bound(layers)
    step, tie, why = _assess(tokens, theirs, top, dtype, against, own_top, bound)
    if step is None:
        return why or None
    where = f"token {step + 1}: {tokens[step]} against the {against}'s {theirs[step]}"
    if tie is not None:
        return f"{where} (a near-tie: {tie.ulps:.1f} ulps)"
    return f"{where} ({why}; a tie is within {bound:.0f} ulps at {layers} layers)"
