"""The merge of partial states: exactness, empty states, and its algebra (hypothesis)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tolerances import assert_state_close, random_decode_inputs
from tree_attn import ShapeError, merge_partials
from tree_attn.kernels.reference import decode_attention_float64
from tree_attn.reduce.state import empty_state, merge_states, merge_two


def _split_states(q, k, v, cuts):
    """States of the key ranges between consecutive ``cuts`` (float64 truth per range)."""
    outs, lses = [], []
    for a, b in itertools.pairwise(cuts):
        o, l = decode_attention_float64(q, k[:, a:b], v[:, a:b])
        outs.append(o.float())
        lses.append(l.float())
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("cuts", [[0, 40], [0, 10, 40], [0, 0, 13, 13, 40], [0, 1, 2, 3, 40], [0, 40, 40]])
def test_merge_of_splits_equals_whole(cuts):
    q, k, v = random_decode_inputs(2, 8, 2, 16, 40, seed=1)
    outs, lses = _split_states(q, k, v, cuts)
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_empty_inf_and_nan_lse_are_ignored():
    q, k, v = random_decode_inputs(1, 4, 4, 8, 12, seed=2)
    outs, lses = _split_states(q, k, v, [0, 5, 12])
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    garbage = torch.full_like(outs[0], float("nan"))
    for bad in (float("-inf"), float("inf"), float("nan")):
        o = torch.cat([outs, garbage[None]])
        l = torch.cat([lses, torch.full_like(lses[0], bad)[None]])
        out, lse = merge_partials(o, l)
        assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_all_empty_rows_give_zero_and_minus_inf():
    outs = torch.randn(3, 2, 4, 8)
    lses = torch.randn(3, 2, 4)
    lses[:, 1, 2] = float("-inf")
    lses[0, 0, 0], lses[1, 0, 0], lses[2, 0, 0] = float("nan"), float("inf"), float("-inf")
    out, lse = merge_partials(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[1, 2] == 0).all() and torch.isneginf(lse[1, 2])
    assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, 0])
    assert torch.isfinite(lse[1, 1])


def test_zero_states():
    out, lse = merge_partials(torch.zeros(0, 2, 3, 4), torch.zeros(0, 2, 3))
    assert out.shape == (2, 3, 4) and (out == 0).all() and torch.isneginf(lse).all()


def test_large_lse_does_not_overflow():
    outs = torch.randn(2, 1, 1, 4)
    lses = torch.tensor([[[1e4]], [[1e4 + math.log(3.0)]]])
    out, lse = merge_partials(outs, lses)
    expected = 0.25 * outs[0] + 0.75 * outs[1]
    # float32 holds 1e4 + log(3) to within 1e-3, so the weights are exact to about that.
    assert torch.allclose(out, expected, atol=5e-3)
    assert abs(lse.item() - (1e4 + math.log(4.0))) < 1e-2


def test_lse_spread_far_beyond_exp_range_with_empty_states():
    """Scale-free: lses hundreds apart (exp of the spread overflows float32) beside empty states,
    against the float64 merge written out: the shift must be the largest lse, not any other."""
    g = torch.Generator().manual_seed(5)
    outs = torch.randn(5, 3, 4, 8, generator=g)
    lses = torch.randn(5, 3, 4, generator=g) * 200
    lses[1, 0] = float("-inf")  # one empty state in every head of row 0
    lses[:4, 2, 1] = float("-inf")  # one state alone
    out, lse = merge_partials(outs, lses)
    ref_lse = torch.logsumexp(lses.double(), dim=0)
    w = torch.exp(lses.double() - ref_lse)
    ref_out = (w.unsqueeze(-1) * outs.double()).sum(dim=0)
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=0)
    assert torch.allclose(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2, 1], outs[4, 2, 1]) and lse[2, 1] == lses[4, 2, 1]


def test_own_states_with_nan_or_inf_lse_poison_their_row_only():
    """States our kernels made: a NaN or +inf lse in either state (from NaN/inf data) makes that
    row's out and lse NaN, as torch SDPA gives; the other rows merge as usual."""
    g = torch.Generator().manual_seed(6)
    oa, ob = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    la, lb = torch.randn(4, generator=g), torch.randn(4, generator=g)
    la[0], lb[1], la[2] = float("nan"), float("inf"), float("-inf")
    out, lse = merge_two(oa, la, ob, lb)
    assert torch.isnan(out[:2]).all() and torch.isnan(lse[:2]).all()
    assert torch.equal(out[2], ob[2]) and lse[2] == lb[2]  # an empty state is not a faulty one
    clean_out, clean_lse = merge_partials(torch.stack([oa[3:], ob[3:]]), torch.stack([la[3:], lb[3:]]))
    assert torch.equal(out[3:], clean_out) and torch.equal(lse[3:], clean_lse)


def test_float64_merge_keeps_float64_precision():
    """The float64 merge (what ``tree-attn run``'s reference is merged with) computes in float64
    throughout: split float64 states merge to the unsplit float64 truth to ~1e-13, far below
    what a float32 step anywhere in it would leave (~1e-7)."""
    q, k, v = random_decode_inputs(2, 8, 2, 16, 57, seed=7)
    cuts = [0, 9, 9, 30, 57]
    parts = [decode_attention_float64(q, k[:, a:b], v[:, a:b]) for a, b in itertools.pairwise(cuts)]
    out, lse = merge_states(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]), dtype=torch.float64)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_shape_errors_name_the_shapes():
    with pytest.raises(ShapeError, match=r"outs \(3, 2, 4\).*lses \(2, 2\)"):
        merge_partials(torch.zeros(3, 2, 4), torch.zeros(2, 2))


# --- algebra ---------------------------------------------------------------------------------

_lse_value = st.one_of(st.floats(-50, 50, allow_nan=False), st.just(float("-inf")))


@st.composite
def _state(draw):
    lse = torch.tensor([draw(_lse_value) for _ in range(3)], dtype=torch.float32)
    out = torch.tensor([[draw(st.floats(-10, 10)) for _ in range(4)] for _ in range(3)], dtype=torch.float32)
    out[torch.isneginf(lse)] = 0.0  # an empty state's output is 0 by contract
    return out, lse


def _close(a, b):
    (oa, la), (ob, lb) = a, b
    assert torch.equal(torch.isneginf(la), torch.isneginf(lb))
    fin = torch.isfinite(la)
    assert torch.allclose(la[fin], lb[fin], atol=1e-4, rtol=1e-6)
    assert torch.allclose(oa, ob, atol=1e-4, rtol=1e-4)


@settings(max_examples=150, deadline=None)
@given(_state(), _state(), _state())
def test_merge_is_associative(a, b, c):
    left = merge_two(*merge_two(*a, *b), *c)
    right = merge_two(*a, *merge_two(*b, *c))
    _close(left, right)


@settings(max_examples=150, deadline=None)
@given(_state(), _state())
def test_merge_is_commutative(a, b):
    _close(merge_two(*a, *b), merge_two(*b, *a))


@settings(max_examples=150, deadline=None)
@given(_state())
def test_empty_state_is_identity(a):
    for empty in ((torch.zeros(3, 4), torch.full((3,), float("-inf"))), empty_state((3,), 4)):
        _close(merge_two(*a, *empty), a)
        _close(merge_two(*empty, *a), a)
