"""What a delegated link's staging rings hold, measured as the resident shared memory of each end, and
that cutting messages to fit a queue's ring keeps the queues of a delayed link working side by side.

With whole slots each message takes a slot of its own, so the rings' pages grow with every slot
messages reached: 8 messages of 4 MiB over 2 queues of 4 slots touch 32 MiB at each end. Cut to fit
one queue's ring (``fit_ring``, what a memory budget asks for on CPU), a message travels in 4 pieces of
1 MiB and a queue's ring holds one message's bytes: 2 queues, 8 MiB at each end, however many
messages pass; and each piece's pages are given back once it has been taken out of its ring, so
once every message has arrived the rings hold nothing.
"""
import bodies
import pytest
from workers import launch

MIB = 1024


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fit_ring", [False, True])
def test_rings_hold_one_message_per_queue_when_cut_to_fit(fit_ring):
    n, mib, queues = 8, 4, 2
    res = launch(2, bodies.ring_residency, fit_ring, n, mib)
    for r in (0, 1):
        assert res[r]["ok"] == ([] if r == 0 else [True] * n), res[r]
    resident = [res[r]["resident_kib"] for r in (0, 1)]
    if not fit_ring:  # every message in a slot of its own: 8 x 4 MiB at each end
        assert all(kib >= 0.9 * n * mib * MIB for kib in resident), resident
    else:  # each piece's pages leave once it is taken out: once every message arrived, only the rings'
        # own headers stay (at most 4 slots x 1 MiB per queue, 2 queues, 8 MiB, while messages pass)
        assert all(kib <= 256 for kib in resident), resident


@pytest.mark.timeout(150)
def test_a_cut_message_fits_its_ring_and_never_holds_the_next_queue_behind_its_own_delay():
    """Link 0 delayed 2 s per message, two messages of 4 MiB, one per queue: both are copied into their
    rings within 1.6 s, while the first queue's delegate still holds its message for the delay (a
    message cut finer than its ring would wait there for that delegate, and the second behind it)."""
    res = launch(2, bodies.copies_beside_a_delay, 4, 2000.0)
    assert res[0]["fit_ring"] and res[0]["copied_in_time"] is True, res[0]
    assert res[1]["ok"] == [True, True], res[1]
