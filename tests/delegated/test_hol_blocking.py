"""Head-of-line blocking is real on a slow direct link; a delegated one delivers the same messages.

30 ms on link 0; the sender issues 8 activation sends, each after a 10 ms 'op'. Direct (FIFO with one
message in flight, DelayInjector): from the second message on, each send waits for the previous
message to land, so the 8 sends take at least 7 x 30 ms however the machine is loaded. Delegated (2
queues, the delay applied inside the delegates): each send only copies into a staging slot. How long
a send takes on each path is a wall-clock measurement, made by benchmarks/transport/delegation_hol.py (per
send on the slow link, per mode, with every mode under the same load); no test bounds it from above.
"""
import bodies
import pytest
from workers import launch

DELAY_MS, OP_MS, SENDS = 30.0, 10.0, 8


@pytest.mark.timeout(150)
def test_a_slow_direct_link_holds_the_sender_and_both_paths_deliver_every_message_late():
    direct = launch(2, bodies.hol, "off", DELAY_MS, SENDS, OP_MS, 1)
    # Two rounds on the delegated path: the delegates are reused.
    deleg = launch(2, bodies.hol, "always", DELAY_MS, SENDS, OP_MS, 2)
    assert direct[1]["ok"] == [True] * SENDS and deleg[1]["ok"] == [True] * (2 * SENDS)
    for res in (direct, deleg):
        assert all(a[0] >= DELAY_MS / 1000 * 0.9 for a in res[1]["arrivals"])  # the delay applies on both paths
    # Direct: send m returns only once message m - 1 has landed, and each lands 30 ms after the one
    # before it: the sender is held at least (SENDS - 1) x 30 ms on the wire (a lower bound: load
    # only lengthens it).
    assert direct[0]["issued"][0] >= (SENDS - 1) * DELAY_MS / 1000 * 0.9, direct[0]["issued"]
    assert len(deleg[0]["took"]) == 2 and all(len(t) == SENDS for t in deleg[0]["took"])
