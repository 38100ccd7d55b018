"""The pure layer split shared by the planner and the runtime."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardserve.planner.layer_split import split_layers


@pytest.mark.parametrize("n, stages, first, last, expected", [
    (10, 3, 0, 0, [4, 3, 3]),
    (32, 4, 0, 0, [8, 8, 8, 8]),
    (32, 2, 2.5, 2.5, [16, 16]),
    (12, 2, 5, 0.1, [4, 8]),     # a heavy embedding pushes layers to the last stage
    (12, 2, 0, 5, [9, 3]),       # a heavy LM head pushes them to the first
    (48, 3, 2.7, 2.7, [15, 18, 15]),
    (5, 5, 9, 9, [1, 1, 1, 1, 1]),
    (7, 1, 3, 3, [7]),
])
def test_uniform_layers(n, stages, first, last, expected):
    assert split_layers([1.0] * n, stages, first, last) == expected


def test_uneven_layers_balance_the_largest_stage():
    assert split_layers([1, 1, 1, 4, 1, 1, 1], 2) == [4, 3]
    assert split_layers([5, 1, 1, 1, 1, 1], 2) == [1, 5]


def test_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 pipeline stages"):
        split_layers([1.0] * 4, 5)


@given(costs=st.lists(st.floats(0.1, 10), min_size=1, max_size=40), data=st.data())
def test_split_is_contiguous_and_minimises_the_largest_stage(costs, data):
    stages = data.draw(st.integers(1, len(costs)))
    first, last = data.draw(st.floats(0, 20)), data.draw(st.floats(0, 20))
    split = split_layers(costs, stages, first, last)
    assert len(split) == stages and sum(split) == len(costs) and min(split) >= 1

    def worst(counts):
        out, start = [], 0
        for s, c in enumerate(counts):
            out.append(sum(costs[start:start + c]) + (first if s == 0 else 0)
                       + (last if s == stages - 1 else 0))
            start += c
        return max(out)

    # no split moving one boundary by one layer does better
    for i in range(stages - 1):
        for delta in (-1, 1):
            other = list(split)
            other[i] += delta
            other[i + 1] -= delta
            if min(other) >= 1:
                assert worst(split) <= worst(other) * (1 + 1e-9)
