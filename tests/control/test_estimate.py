"""The link-delay estimator: message times from op records, transits per direction, per link and pipeline."""
from types import SimpleNamespace as Rec

from ds_pipemorph.control.estimate import Neighbours, RankTimes, add_transits, link_delay_ms, link_delays, message_times

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


def ops(*spec):
    """Op records from (op, start_ms, end_ms)."""
    return [Rec(op=op, start_ns=a * MS, end_ns=b * MS) for op, a, b in spec]


def test_message_times_lay_out_sends_receives_and_clock_offsets():
    N = 2
    recs = ops(("F0", 0, 10), ("SEND_F0", 10, 11), ("RECV_B1", 20, 30), ("SEND_F1", 31, 33), ("RECV_F0", 1, 2),
               ("SEND_B0", 3, 4), ("RECV_B0", 40, 45), ("SEND_F2", 50, 51),  # micro-batch 2 >= N: ignored
               ("W1", 60, 61))
    t = message_times(recs, N, stage=1, clock_offsets={0: 7, 2: -3})
    assert t[0:2] == [11 * MS, 33 * MS]                       # SEND_F ends by micro-batch
    assert t[2:4] == [4 * MS, -1]                             # SEND_B ends
    assert t[4:8] == [1 * MS, 2 * MS, -1, -1]                 # RECV_F (start, end) pairs
    assert t[8:12] == [40 * MS, 45 * MS, 20 * MS, 30 * MS]    # RECV_B pairs
    assert t[12:] == [7.0, -3.0]                              # clock minus upstream's, minus downstream's
    assert message_times([], N, stage=0, clock_offsets={})[12:] == [0.0, 0.0]  # no estimate: 0


def test_link_delay_pairs_each_receiver_with_its_sender_and_the_slowest_pipeline_counts():
    """Two data-parallel pipelines of two stages (ranks 0-1 and 2-3). In the first, rank 1's clock runs
    5 ms ahead of rank 0's; exact transits 30, 32 (F) and 34 (B): 32 ms. The second's are 40, 42, 44: 42 ms.
    Late receives (started after the send) only bound the transit and do not count."""
    N = 2
    r0 = ops(("SEND_F0", 9, 10), ("SEND_F1", 19, 20), ("RECV_B0", 30, 79), ("RECV_B1", 70, 100))
    r1 = ops(("RECV_F0", 5, 45), ("RECV_F1", 20, 57), ("SEND_B0", 49, 50), ("SEND_B1", 64, 65))
    r2 = ops(("SEND_F0", 9, 10), ("SEND_F1", 19, 20), ("RECV_B0", 0, 89), ("RECV_B1", 100, 110))
    r3 = ops(("RECV_F0", 0, 50), ("RECV_F1", 10, 62), ("SEND_B0", 44, 45), ("SEND_B1", 59, 60))
    ranks = {
        0: RankTimes(0, Neighbours(None, 1), message_times(r0, N, 0, {1: -5 * MS})),
        1: RankTimes(1, Neighbours(0, None), message_times(r1, N, 1, {0: 5 * MS})),
        2: RankTimes(0, Neighbours(None, 3), message_times(r2, N, 0, {})),
        3: RankTimes(1, Neighbours(2, None), message_times(r3, N, 1, {})),
    }
    assert link_delays({r: ranks[r] for r in (0, 1)}, 1, N, [None]) == [32.0]
    assert link_delays({r: ranks[r] for r in (2, 3)}, 1, N, [None]) == [42.0]
    assert link_delays(ranks, 1, N, [None]) == [42.0]


def test_a_link_whose_far_end_sent_nothing_reads_none():
    N = 1
    r0 = ops(("SEND_F0", 0, 1))
    r1 = ops(("RECV_F0", 0, 4))  # stage 1's downstream neighbour (rank 5) has no row
    ranks = {0: RankTimes(0, Neighbours(None, 1), message_times(r0, N, 0, {})), 1: RankTimes(1, Neighbours(0, 5), message_times(r1, N, 1, {}))}
    assert link_delays(ranks, 2, N, [None, None]) == [3.0, None]
