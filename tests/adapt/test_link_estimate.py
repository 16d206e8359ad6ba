"""The control loop's link delay from one iteration's message times (pure logic, no ranks)."""
from ds_pipemorph.runtime.adapt import add_transits, link_delay_ms

MS = 1_000_000


def test_a_receive_posted_before_the_send_is_exact_and_a_late_one_only_bounds():
    sent = [10 * MS, 20 * MS, 30 * MS]
    recv = [0, 40 * MS,            # waiting since 0: exact, 30 ms
            45 * MS, 46 * MS,      # started after the send: at most 26 ms (a bound)
            25 * MS, 62 * MS]      # started before the send ended at 30: exact, 32 ms
    exact, bounds = [], []
    add_transits(exact, bounds, sent, recv, offset=0)
    assert exact == [30.0, 32.0] and bounds == [30.0, 26.0, 32.0]
    assert link_delay_ms(exact, bounds) == 31.0  # the median of the exact ones, not the luckiest bound


def test_a_long_receive_is_no_proof_of_waiting_for_the_wire():
    """Descheduled after its message came, a receive looks long: it stays a bound, not a sample."""
    exact, bounds = [], []
    add_transits(exact, bounds, [10 * MS], [12 * MS, 30 * MS], offset=0)
    assert exact == [] and bounds == [20.0]
    assert link_delay_ms(exact, bounds) == 20.0  # with nothing exact, the smallest bound


def test_clock_offset_and_missing_messages():
    exact, bounds = [], []
    # the receiver's clock runs 5 ms ahead; message 1 was never received, message 2 never sent
    add_transits(exact, bounds, [10 * MS, 20 * MS, -1], [14 * MS, 20 * MS, -1, -1, 0, 50 * MS], offset=5 * MS)
    assert exact == [5.0] and bounds == [5.0]


def test_on_a_delegated_link_a_message_that_may_have_queued_is_not_a_sample():
    """Two FIFOs, 30 ms each: messages 0-3 sent at once; 2 and 3 queue behind 0 and 1 (arrive at 60)."""
    sent = [0, 0, 0, 0]
    recv = [-5 * MS, 30 * MS, -5 * MS, 30 * MS, -5 * MS, 60 * MS, -5 * MS, 60 * MS]
    exact, bounds = [], []
    add_transits(exact, bounds, sent, recv, offset=0, fifos=2)
    assert exact == [30.0, 30.0] and bounds == [30.0, 30.0, 60.0, 60.0]
    exact = []
    add_transits(exact, [], sent, recv, offset=0)  # read as a direct link, the queueing would count
    assert exact == [30.0, 30.0, 60.0, 60.0]
    # sent after the two before it arrived: no queueing possible, exact again
    exact = []
    add_transits(exact, [], [0, 0, 31 * MS], [-5 * MS, 30 * MS, -5 * MS, 30 * MS, 0, 61 * MS], offset=0, fifos=2)
    assert exact == [30.0, 30.0, 30.0]
