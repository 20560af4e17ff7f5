"""When a row of generate may part from the reference: only at a near-tie of the reference's own
logits, within TIE_ULPS ulps of the model's dtype (tree_attn/commands/generate/ties.py)."""

import pytest
import torch

from tree_attn.commands.generate.decode import ONE_RANK, REFERENCE, GenerateRow, _check
from tree_attn.commands.generate.ties import TIE_ULPS, TOP_K, NearTie, StepTop, near_tie, parting, step_top, ulp

BF16 = torch.bfloat16


def _top(*pairs) -> StepTop:
    return StepTop(tuple(i for i, _ in pairs), tuple(float(v) for _, v in pairs))


# The reference's best logits per step; at step 2 its token 3 leads token 9 by 0.75 (6 bf16 ulps at
# 21.5, the H100 case) and token 5 by 1.25 (10 ulps).
REF = [1, 2, 3, 4]
TOP = [_top((1, 30.0), (8, 20.0)), _top((2, 25.0), (7, 24.0)), _top((3, 21.5), (9, 20.75), (5, 20.25)),
       _top((4, 19.0), (6, 18.0))]


def test_ulp_is_the_spacing_of_the_dtype_at_the_value():
    assert ulp(21.5, BF16) == 0.125 and ulp(-21.5, BF16) == 0.125 and ulp(16.0, BF16) == 0.125
    assert ulp(15.99, BF16) == 0.0625 and ulp(1.0, torch.float32) == 2.0 ** -23 and ulp(1000.0, torch.float16) == 0.5
    for dtype in (BF16, torch.float16, torch.float32):  # the next value up is one ulp away, none between
        step = ulp(21.5, dtype)
        assert torch.tensor(21.5 + step, dtype=dtype).item() == 21.5 + step
        assert torch.tensor(21.5 + step / 4, dtype=dtype, device="cpu").item() == 21.5
    assert ulp(0.0, torch.float32) > 0


def test_a_part_at_a_near_tie_is_one_within_tie_ulps_of_the_reference_logits():
    tie = near_tie([1, 2, 9, 11], REF, TOP, BF16)
    assert tie == NearTie(step=2, token=9, their_token=3, gap=0.75, ulps=6.0, dtype="bfloat16", against="reference")
    assert tie.to_dict()["ulps"] == 6.0
    assert "at token 3 it chose 9, the reference 3" in tie.describe() and "6.0 ulps of bfloat16" in tie.describe()
    assert near_tie([1, 2, 5, 4], REF, TOP, BF16) is None  # 10 ulps: a difference
    assert near_tie([1, 2, 9, 4], REF, TOP, torch.float32) is None  # 0.75 is millions of float32 ulps
    assert near_tie([1, 2, 3, 4], REF, TOP, BF16) is None  # no part
    assert near_tie([1, 2, 42, 4], REF, TOP, BF16) is None  # not among the reference's best
    assert near_tie([1, 7, 3, 4], REF, TOP, BF16).ulps == TIE_ULPS == 8  # 1.0 at 25: 8 bf16 ulps, a tie
    assert near_tie([1, 7, 3, 4], REF, TOP, torch.float16) is None  # 64 fp16 ulps
    assert near_tie([1, 2, 9], REF, TOP, BF16) is None  # a row of another length
    assert near_tie([1, 2, 9, 4], REF, TOP[:2], BF16) is None  # no logits recorded for that step
    assert near_tie([5, 2, 3, 4], REF, TOP, BF16) is None  # 10.0 apart at step 0


def test_parting_says_where_and_how_far():
    assert parting(REF, REF, TOP, BF16) is None
    assert parting([1, 2, 5, 4], REF, TOP, BF16) == (
        "token 3: 5 against the reference's 3 (the reference's logits for the two differ by 1.25, 10.0 ulps of "
        f"bfloat16; a tie is within {TIE_ULPS})")
    assert parting([1, 2, 42, 4], REF, TOP, BF16) == \
        "token 3: 42 against the reference's 3 (not among the reference's 3 best logits there)"
    assert parting([1, 2, 3], REF, TOP, BF16) == "3 tokens against the reference's 4"


def test_step_top_is_the_best_logits_best_first():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5, 2.0], dtype=BF16)
    top = step_top(logits, k=3)
    assert top.ids == (1, 3, 4) and top.logits == (3.0, 2.5, 2.0) and top.logit_of(4) == 2.0 and top.logit_of(0) is None
    assert len(step_top(torch.randn(100)).ids) == TOP_K and len(step_top(torch.randn(3)).ids) == 3


def test_check_passes_a_near_tie_as_such_and_nothing_else():
    def rows(*tokens_by_row):
        ref = GenerateRow(REFERENCE, 1, list(REF), [0.01] * 4, top=TOP)
        return [ref] + [GenerateRow(name, 2, list(t), [0.01] * 4) for name, t in tokens_by_row]

    r = rows((ONE_RANK, REF), ("tree k=2", [1, 2, 9, 11]), ("ring", [1, 2, 5, 4]))
    assert _check(r, BF16) == REFERENCE
    _, one, tree, ring = r
    assert one.ok and one.matches and one.near_tie is None
    assert tree.ok and not tree.matches and tree.near_tie.step == 2 and tree.same_tokens == 2
    assert tree.to_dict()["near_tie"]["their_token"] == 3 and tree.to_dict()["matches"] is False
    assert not ring.ok and ring.near_tie is None and ring.to_dict()["near_tie"] is None
    tree.ranks_agree = False  # a tie with the reference never excuses ranks that disagree
    assert not tree.ok
    r = rows(("tree k=2", [1, 2, 9, 11]))
    assert _check(r) == REFERENCE and not r[1].ok  # no dtype given: exact tokens only
    assert _check(r, torch.float32) == REFERENCE and not r[1].ok


def test_without_the_reference_ties_are_judged_by_the_yardstick_rows_own_logits():
    """Without the reference, the one-rank row (else the first row) is the yardstick, with the
    logits its rank 0 recorded; a yardstick without recorded logits allows no tie."""
    skipped = GenerateRow(REFERENCE, 1, [], [], skipped="skipped: x")
    one = GenerateRow(ONE_RANK, 1, list(REF), [0.01] * 4, top=TOP)
    tree = GenerateRow("tree k=2", 2, [1, 2, 9, 11], [0.01] * 4)
    assert _check([skipped, one, tree], BF16) == ONE_RANK and tree.ok and tree.near_tie.against == ONE_RANK
    assert "the one rank 3, whose own logits" in tree.near_tie.describe()
    skipped_one = GenerateRow(ONE_RANK, 1, [], [], skipped="skipped: x")
    first = GenerateRow("tree k=2", 2, list(REF), [0.01] * 4, top=TOP)
    ring = GenerateRow("ring", 2, [1, 2, 5, 4], [0.01] * 4)
    allreduce = GenerateRow("allreduce", 2, [1, 2, 9, 4], [0.01] * 4)
    assert _check([skipped, skipped_one, first, ring, allreduce], BF16) == "each other"
    assert not ring.ok and allreduce.ok and allreduce.near_tie.against == "tree k=2"
    bare = GenerateRow(ONE_RANK, 1, list(REF), [0.01] * 4)  # no logits recorded
    tree = GenerateRow("tree k=2", 2, [1, 2, 9, 11], [0.01] * 4)
    assert _check([skipped, bare, tree], BF16) == ONE_RANK and not tree.ok
    assert parting(tree.tokens, bare.tokens, bare.top, BF16, against=ONE_RANK) == \
        "token 3: 9 against the one rank's 3 (no logits of the one rank recorded there)"


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_a_gap_of_tie_ulps_at_any_scale_is_a_tie_and_one_more_is_not(dtype):
    for best in (0.7, 3.0, 21.5, 300.0):
        step = ulp(best, dtype)
        for ulps, tie in ((TIE_ULPS, True), (TIE_ULPS + 1, False)):
            top = [_top((1, best), (2, best - ulps * step))]
            assert (near_tie([2], [1], top, dtype) is not None) is tie, (best, ulps)
