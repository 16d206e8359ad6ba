"""Any dtype, shape and tuple goes through the delegates, with 1 and 3 queues, consumed in any order.

4 KiB staging slots force the bigger messages into several pieces.
"""
import bodies
import pytest
from workers import launch

N = 10


@pytest.mark.timeout(150)
@pytest.mark.parametrize("queues,order", [(1, "in order"), (3, "reversed")])
def test_many_dtypes_shapes_and_tuples_arrive_intact_in_any_consumption_order(queues, order):
    mbs = list(range(N)) if order == "in order" else list(reversed(range(N)))
    res = launch(2, bodies.roundtrip, queues, mbs, 4096)
    for r in (0, 1):
        assert res[r]["ok"] == [True] * (2 * N), res[r]
        assert res[r]["delegates"] == 2 * queues  # one per queue and direction, reused by both iterations
        assert res[r]["events"] == []


@pytest.mark.timeout(150)
def test_posted_receives_are_prefetched_off_the_training_thread_and_unposted_ones_are_not():
    n = 6
    res = launch(2, bodies.prefetch, n, 4096)[1]  # 4 KiB slots: several pieces per message
    assert res["stashed_before_recv"] == list(range(n))
    assert res["ok"] == [True] * n and res["unposted_ok"]
