"""The one count syntax (``tree_attn.sizes``): K = 1,024, M = 1,000,000, exact decimals that must
come out whole, a sign left for the option's own range check, lists in the order given."""

from __future__ import annotations

import pytest

from tree_attn.errors import ConfigError
from tree_attn.sizes import parse_count, parse_count_list


@pytest.mark.parametrize("text, count", [
    ("65536", 65536), ("64K", 65536), (" 64k ", 65536), ("5.12M", 5_120_000), ("4.1M", 4_100_000),
    ("1.5K", 1536), ("0.5K", 512), ("2m", 2_000_000), ("0", 0), ("-1", -1), ("-2K", -2048), ("+3", 3), (7, 7),
])
def test_counts(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("bad", ["64X", "0.3K", "0.5", "2.5", "1.", ".5K", "1e6", "", "K", "5G", "1,000", "--1",
                                 True, False, None])
def test_what_is_not_a_count_is_refused(bad):
    with pytest.raises(ConfigError, match="not a"):
        parse_count(bad)


def test_count_lists_keep_their_order_and_skip_empty_items():
    assert parse_count_list("16K,1m") == [16384, 1_000_000]
    assert parse_count_list("1M,16K,300") == [1_000_000, 16384, 300]  # as given: a sweep runs in this order
    assert parse_count_list(" 16K, ,64K,") == [16384, 65536]
    for bad in ("", " , ", ","):
        with pytest.raises(ConfigError, match="comma-separated list of counts"):
            parse_count_list(bad)
    with pytest.raises(ConfigError, match="'0.3K' is not a whole number"):
        parse_count_list("16K,0.3K")
