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
from tree_attn.reduce.state import merge_two


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
    empty = (torch.zeros(3, 4), torch.full((3,), float("-inf")))
    _close(merge_two(*a, *empty), a)
    _close(merge_two(*empty, *a), a)
