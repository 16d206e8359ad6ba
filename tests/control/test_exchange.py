"""When the control loops exchange (``control.exchange``): further apart while nothing changes, every
iteration as soon as something does, and a slow link acted on at most ``max_gap - 1`` iterations
later than with an exchange every iteration (the real policy and detector, fed at the exchanges only)."""
import math

import pytest

from ds_pipemorph.control.exchange import MAX_GAP, ExchangeSchedule, exchange_iterations
from ds_pipemorph.control.policy import ControlPolicy
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import initial_warmup

S, N = 4, 8
OPS = ([10.0] * S,) * 3
CALM = [0.3, 0.2, 0.4]
SLOW = [0.3, 0.2, 30.4]  # link 2 at 30.4 ms: more than the first plan absorbs


def test_while_nothing_changes_the_gap_doubles_up_to_the_cap():
    # The first exchange is not quiet (nothing observed yet), every later one is.
    assert exchange_iterations(48, lambda i: i > 0, max_gap=8) == [0, 1, 3, 7, 15, 23, 31, 39, 47]
    assert MAX_GAP == 8


def test_a_loop_that_is_not_quiet_brings_the_next_exchange_to_the_next_iteration():
    changing = {15, 16}  # e.g. a detector counting a slow link at 15, acting at 16
    got = exchange_iterations(40, lambda i: i > 0 and i not in changing, max_gap=8)
    assert got == [0, 1, 3, 7, 15, 16, 17, 19, 23, 31, 39]


def test_max_gap_1_exchanges_every_iteration_and_0_is_refused():
    assert exchange_iterations(10, lambda i: True, max_gap=1) == list(range(10))
    with pytest.raises(ValueError, match="max_gap must be >= 1"):
        ExchangeSchedule(0)


def _first_reaction(slow_from: int, max_gap: int, every: int = 1, iterations: int = 120) -> tuple[int, int]:
    """(iteration of the policy's first decision, exchanges up to it) for link 2 slow from
    ``slow_from``, the policy fed at the exchanges only and their gaps set by ``ControlPolicy.settled``."""
    p = ControlPolicy(list_schedule(Costs.uniform(S, 10.0), N, initial_warmup([N] * S)), Costs.uniform(S, 10.0), N,
               every=every)
    schedule, exchanges = ExchangeSchedule(max_gap), 0
    for i in range(iterations):
        if schedule.due(i):
            exchanges += 1
            if p.observe(i, *OPS, SLOW if i >= slow_from else CALM) is not None:
                return i, exchanges
            schedule.exchanged(i, p.settled, p.next_run)
    raise AssertionError(f"no decision for a link slow from iteration {slow_from}")


@pytest.mark.parametrize("max_gap", [2, 8, 16])
def test_a_link_slow_from_any_iteration_is_acted_on_at_most_max_gap_minus_1_iterations_late(max_gap):
    for slow_from in range(1, 50):
        every, _ = _first_reaction(slow_from, max_gap=1)
        assert every == slow_from + 1  # two slow iterations in a row, as the detector asks
        late, exchanges = _first_reaction(slow_from, max_gap)
        assert every <= late <= every + max_gap - 1, (slow_from, late)
        # While calm: the first exchange, log2(max_gap) while the gap grows, then one per max_gap
        # iterations; then the two that see the slow link.
        assert exchanges <= 2 + math.log2(max_gap) + slow_from / max_gap, (slow_from, exchanges)


@pytest.mark.parametrize("every", range(2, 17))
def test_a_detector_run_every_k_iterations_decides_when_it_would_with_an_exchange_every_iteration(every):
    # Fed every iteration it runs after iterations k-1, 2k-1, ...; with exchanges growing apart it is
    # given an exchange at each of those (``ControlPolicy.next_run``), so it decides at the same iteration.
    for slow_from in range(1, 50):
        reference, all_exchanges = _first_reaction(slow_from, max_gap=1, every=every)
        late, exchanges = _first_reaction(slow_from, max_gap=8, every=every)
        assert late == reference, (slow_from, late, reference)
        assert exchanges <= all_exchanges  # never more exchanges than one per iteration ...
        if reference > 16:  # ... and fewer once the gaps had time to grow
            assert exchanges < all_exchanges, (slow_from, exchanges, all_exchanges)
