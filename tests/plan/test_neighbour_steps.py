"""``neighbour_steps``: any partition reached from any other by live migrations, each between
neighbouring stages only, moving no layer whose stage is the same at both ends."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.partition.parts import layer_moves, neighbour_steps, owner


@st.composite
def two_partitions(draw):
    stages = draw(st.integers(2, 7))
    layers = draw(st.integers(stages, 24))

    def one():
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1)))
        return [0, *cuts, layers]
    return one(), one()


@settings(max_examples=400, deadline=None)
@given(two_partitions())
def test_every_step_is_one_live_migration_and_the_last_is_the_target(pair):
    old, new = pair
    steps = neighbour_steps(old, new)
    assert (steps[-1] if steps else old) == new
    seen = [old, *steps]
    for a, b in zip(seen, seen[1:]):
        assert a != b
        moves = layer_moves(a, b)  # refuses a layer that skips a stage
        for layer in moves:  # only layers that must change stage move, and always towards their target
            assert owner(old, layer) != owner(new, layer)
            assert abs(owner(b, layer) - owner(new, layer)) < abs(owner(a, layer) - owner(new, layer))
    travel = max((abs(owner(old, x) - owner(new, x)) for x in range(old[-1])), default=0)
    assert len(steps) <= max(travel, 0) + len(old) - 2


def test_worked_example_takes_two_steps_where_one_would_skip_a_stage():
    # Layers 10 and 11 go from stage 2 to stage 0: through stage 1.
    assert neighbour_steps([0, 5, 10, 14, 18], [0, 11, 13, 16, 18]) == [[0, 9, 13, 16, 18], [0, 11, 13, 16, 18]]
    with pytest.raises(BadInput, match="layer 10 would move from stage 2 to stage 0"):
        layer_moves([0, 5, 10, 14, 18], [0, 11, 13, 16, 18])
    assert neighbour_steps([0, 2, 4], [0, 2, 4]) == []


def test_partitions_of_other_models_are_refused():
    with pytest.raises(BadInput, match="the last value must be 18"):
        neighbour_steps([0, 5, 10, 14, 18], [0, 5, 10, 14, 20])
