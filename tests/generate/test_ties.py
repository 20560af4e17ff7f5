"""When a row of generate may part from the row it is checked against: only at a near-tie, within
8 x sqrt(layers) ulps of the model's dtype in both rows' logits, the rows' logits agreeing until
then (tree_attn/commands/generate/ties.py). Most cases here are of 4 layers: a bound of 16 ulps."""

import math
import pickle

import pytest
import torch

from tree_attn.commands.generate.decode import ONE_RANK, REFERENCE, GenerateRow, _check
from tree_attn.commands.generate.ties import TOP_K, NearTie, StepTop, near_tie, parting, step_top, tie_bound, ulp

L = 4  # layers: tie_bound(4) == 16 ulps

BF16 = torch.bfloat16


def _top(*pairs) -> StepTop:
    return StepTop(tuple(i for i, _ in pairs), tuple(float(v) for _, v in pairs))


# The yardstick's best logits per step (bf16 ulp: 0.125 in [16, 32)); at step 2 its token 3 leads
# token 9 by 0.75 (6 ulps at 21.5, the H100 case), token 5 by 2.25 (18 ulps) and token 7 by 2.0 (16).
REF = [1, 2, 3, 4]
TOP = [_top((1, 30.0), (8, 20.0)), _top((2, 25.0), (7, 24.0)), _top((3, 21.5), (9, 20.75), (7, 19.5), (5, 19.25)),
       _top((4, 19.0), (6, 18.0))]
# A row's own logits that agree with TOP within a few ulps and prefer 9 over 3 at step 2.
OWN = [_top((1, 30.25), (8, 20.0)), _top((2, 25.0), (7, 24.125)), _top((9, 21.25), (3, 21.0), (5, 19.5)),
       _top((11, 20.0), (4, 19.0))]


def test_ulp_is_the_spacing_of_the_dtype_at_the_value():
    assert ulp(21.5, BF16) == 0.125 and ulp(-21.5, BF16) == 0.125 and ulp(16.0, BF16) == 0.125
    assert ulp(15.99, BF16) == 0.0625 and ulp(1.0, torch.float32) == 2.0 ** -23 and ulp(1000.0, torch.float16) == 0.5
    for dtype in (BF16, torch.float16, torch.float32):  # the next value up is one ulp away, none between
        step = ulp(21.5, dtype)
        assert torch.tensor(21.5 + step, dtype=dtype).item() == 21.5 + step
        assert torch.tensor(21.5 + step / 4, dtype=dtype).item() == 21.5
    assert ulp(0.0, torch.float32) > 0


def test_a_parting_at_a_near_tie_of_the_yardsticks_logits():
    tie = near_tie([1, 2, 9, 11], REF, TOP, BF16, layers=L)
    assert tie == NearTie(step=2, token=9, their_token=3, gap=0.75, ulps=6.0, dtype="bfloat16")
    assert tie.to_dict()["ulps"] == 6.0 and tie.own_ulps is None and pickle.loads(pickle.dumps(tie)) == tie
    assert "at token 3 it took 9, the reference 3" in tie.describe() and "6.0 ulps of bfloat16" in tie.describe()
    assert near_tie([1, 2, 7, 4], REF, TOP, BF16, layers=L).ulps == tie_bound(L) == 16  # 2.0 at 21.5: 16 ulps
    assert near_tie([1, 2, 5, 4], REF, TOP, BF16, layers=6).ulps == 18  # 18 ulps: within 8 x sqrt(6) = 19.6
    assert tie_bound(16) == 32 and tie_bound(1) == tie_bound(0) == 8
    assert near_tie([1, 2, 5, 4], REF, TOP, BF16, layers=L) is None  # 18 ulps
    assert near_tie([1, 2, 9, 4], REF, TOP, torch.float32, layers=L) is None  # 0.75 is millions of float32 ulps
    assert near_tie([1, 2, 9, 4], REF, TOP, torch.float16, layers=L) is None  # 48 fp16 ulps
    assert near_tie(REF, REF, TOP, BF16, layers=L) is None  # no parting
    assert near_tie([1, 2, 42, 4], REF, TOP, BF16, layers=L) is None  # not among the yardstick's best
    assert near_tie([1, 2, 9], REF, TOP, BF16, layers=L) is None  # a row of another length
    assert near_tie([1, 2, 9, 4], REF, TOP[:2], BF16, layers=L) is None  # no logits recorded for that step
    assert near_tie([8, 2, 3, 4], REF, TOP, BF16, layers=L) is None  # 10.0 apart at step 0


def test_the_rows_own_logits_must_tie_too_and_agree_until_the_parting():
    tie = near_tie([1, 2, 9, 11], REF, TOP, BF16, own_top=OWN, layers=L)
    assert tie.own_ulps == 2.0 and tie.agree_ulps == 4.0  # 21.25 vs 21.0; token 3 at 21.5 vs 21.0 at step 2
    assert "in its own 2.0; the two rows' logits agreed within 4.0 ulps" in tie.describe()
    wide_own = OWN[:2] + [_top((9, 23.75), (3, 21.5))] + OWN[3:]  # its own gap 18 ulps
    assert near_tie([1, 2, 9, 11], REF, TOP, BF16, own_top=wide_own, layers=L) is None
    assert "this row's own logits for the two differ by 18.0 ulps" in parting([1, 2, 9, 11], REF, TOP, BF16,
                                                                               own_top=wide_own, layers=L)
    drifted = [OWN[0], _top((2, 27.25), (7, 24.125))] + OWN[2:]  # 2.25 off at step 1: 18 ulps
    assert near_tie([1, 2, 9, 11], REF, TOP, BF16, own_top=drifted, layers=L) is None
    assert "the two rows' logits differ by up to 18.0 ulps" in parting([1, 2, 9, 11], REF, TOP, BF16,
                                                                        own_top=drifted, layers=L)
    lost = OWN[:2] + [_top((9, 21.25), (5, 19.5))] + OWN[3:]  # the yardstick's token not in its own best
    assert near_tie([1, 2, 9, 11], REF, TOP, BF16, own_top=lost, layers=L) is None
    assert near_tie([1, 2, 9, 11], REF, TOP, BF16, own_top=OWN[:2], layers=L) is None  # none recorded at the parting


def test_non_finite_or_inconsistent_logits_are_a_difference_not_a_crash():
    nan = [_top((1, math.nan), (2, math.nan))]
    inf = [_top((1, math.inf), (2, math.inf))]
    assert near_tie([2], [1], nan, BF16, layers=L) is None and near_tie([2], [1], inf, torch.float16, layers=L) is None
    assert "differ by" in parting([2], [1], inf, torch.float16, layers=L)
    backwards = [_top((2, 20.0), (1, 19.75))]  # the yardstick's token below the row's: not its argmax
    assert near_tie([2], [1], backwards, BF16, layers=L) is None
    assert near_tie([2], [1], [_top((1, 20.0), (2, 19.75))], BF16, own_top=[_top((1, 20.0), (2, 19.75))],
                    layers=L) is None


def test_a_tie_at_the_first_token_is_described_so():
    tie = near_tie([7, 2], [2, 2], [_top((2, 25.0), (7, 24.0))], BF16, against=ONE_RANK, layers=L)
    assert tie.describe().startswith("at the first token it took 7, the one rank 2: the one rank's logits")


def test_parting_says_where_and_why():
    assert parting(REF, REF, TOP, BF16, layers=L) is None
    assert parting([1, 2, 5, 4], REF, TOP, BF16, layers=L) == (
        "token 3: 5 against the reference's 3 (the reference's logits for the two differ by 2.25, 18.0 ulps of "
        "bfloat16; a tie is within 16 ulps at 4 layers)")
    assert parting([1, 2, 42, 4], REF, TOP, BF16, layers=L) == (
        "token 3: 42 against the reference's 3 (not among the reference's 4 best logits there; a tie is within 16 "
        "ulps at 4 layers)")
    assert parting([1, 2, 9, 4], REF, TOP, BF16, layers=L) == \
        "token 3: 9 against the reference's 3 (a near-tie: 6.0 ulps)"
    assert parting([1, 2, 3], REF, TOP, BF16, layers=L) == "3 tokens against 4"


def test_step_top_is_the_best_logits_best_first():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5, 2.0], dtype=BF16)
    top = step_top(logits, k=3)
    assert top.ids == (1, 3, 4) and top.logits == (3.0, 2.5, 2.0) and top.logit_of(4) == 2.0 and top.logit_of(0) is None
    assert len(step_top(torch.randn(100)).ids) == TOP_K and len(step_top(torch.randn(3)).ids) == 3


def test_check_passes_a_near_tie_as_such_and_nothing_else():
    def rows(*tokens_by_row):
        ref = GenerateRow(REFERENCE, 1, list(REF), [0.01] * 4, top=TOP)
        return [ref] + [GenerateRow(name, 2, list(t), [0.01] * 4, top=own) for name, t, own in tokens_by_row]

    r = rows((ONE_RANK, REF, []), ("tree k=2", [1, 2, 9, 11], OWN), ("ring", [1, 2, 5, 4], []))
    assert _check(r, BF16, L) == REFERENCE
    _, one, tree, ring = r
    assert one.ok and one.matches and one.near_tie is None
    assert tree.ok and not tree.matches and tree.near_tie.step == 2 and tree.same_tokens == 2
    assert tree.near_tie.own_ulps == 2.0  # the row's own logits were used
    assert tree.to_dict()["near_tie"]["their_token"] == 3 and tree.to_dict()["matches"] is False
    assert not ring.ok and ring.near_tie is None and ring.to_dict()["near_tie"] is None
    tree.ranks_agree = False  # a tie never excuses ranks that disagree
    assert not tree.ok
    r = rows(("tree k=2", [1, 2, 9, 11], OWN))
    assert _check(r) == REFERENCE and not r[1].ok  # no dtype given: exact tokens only
    assert _check(r, torch.float32, L) == REFERENCE and not r[1].ok


def test_without_the_reference_ties_are_judged_by_the_yardstick_rows_own_logits():
    """Without the reference, the one-rank row (else the first row) is the yardstick, with the
    logits its rank 0 recorded; a yardstick without recorded logits allows no tie."""
    skipped = GenerateRow(REFERENCE, 1, [], [], skipped="skipped: x")
    one = GenerateRow(ONE_RANK, 1, list(REF), [0.01] * 4, top=TOP)
    tree = GenerateRow("tree k=2", 2, [1, 2, 9, 11], [0.01] * 4, top=OWN)
    assert _check([skipped, one, tree], BF16, L) == ONE_RANK and tree.ok and tree.near_tie.against == ONE_RANK
    assert "the one rank 3: the one rank's logits" in tree.near_tie.describe()
    skipped_one = GenerateRow(ONE_RANK, 1, [], [], skipped="skipped: x")
    first = GenerateRow("tree k=2", 2, list(REF), [0.01] * 4, top=TOP)
    ring = GenerateRow("ring", 2, [1, 2, 5, 4], [0.01] * 4)
    allreduce = GenerateRow("allreduce", 2, [1, 2, 9, 4], [0.01] * 4)
    assert _check([skipped, skipped_one, first, ring, allreduce], BF16, L) == "each other"
    assert not ring.ok and allreduce.ok and allreduce.near_tie.against == "tree k=2"
    bare = GenerateRow(ONE_RANK, 1, list(REF), [0.01] * 4)  # no logits recorded
    tree = GenerateRow("tree k=2", 2, [1, 2, 9, 11], [0.01] * 4)
    assert _check([skipped, bare, tree], BF16, L) == ONE_RANK and not tree.ok
    assert parting(tree.tokens, bare.tokens, bare.top, BF16, against=ONE_RANK, layers=L) == (
        "token 3: 9 against the one rank's 3 (no logits of the one rank recorded there; a tie is within 16 ulps at 4 "
        "layers)")


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_a_gap_of_tie_ulps_at_any_scale_is_a_tie_and_one_more_is_not(dtype):
    for best in (0.7, 3.0, 21.5, 300.0, -5.0):
        step = ulp(best, dtype)
        for ulps, tie in ((tie_bound(L), True), (tie_bound(L) + 1, False)):
            top = [_top((1, best), (2, best - ulps * step))]
            assert (near_tie([2], [1], top, dtype, layers=L) is not None) is tie, (best, ulps)
