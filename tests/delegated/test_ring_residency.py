"""What a delegated link's staging rings hold, measured as the resident shared memory of each end.

With whole slots, each message takes a slot of its own, so the rings' pages grow with every slot
that messages reached: 8 messages of 4 MiB over 2 queues of 4 slots touch 32 MiB at each end. With
``held_messages`` (the send window, under a memory budget) a message is cut into pieces small enough
that every slot of the direction's rings (up to 4 queues x 4 slots) holds at most that many messages'
bytes: one 4 MiB message's worth, in pieces of 256 KiB, whatever the number of messages sent.
"""
import bodies
import pytest
from workers import launch

MIB = 1024


@pytest.mark.timeout(150)
@pytest.mark.parametrize("held", [None, 1])
def test_rings_hold_a_window_of_messages_when_a_budget_asks_for_it(held):
    n, mib = 8, 4
    res = launch(2, bodies.ring_residency, held, n, mib)
    for r in (0, 1):
        assert res[r]["ok"] == ([] if r == 0 else [True] * n), res[r]
    resident = [res[r]["resident_kib"] for r in (0, 1)]
    if held is None:  # every message in a slot of its own: 8 x 4 MiB at each end
        assert all(kib >= 0.9 * n * mib * MIB for kib in resident), resident
    else:  # 16 slots x 256 KiB at most: 4 MiB, one message (and a little for the rings' own headers)
        assert all(kib <= held * mib * MIB + 256 for kib in resident), resident
