"""Round trips through one staging ring inside one process: dtypes, shapes, FIFO order, `out`, try_pop."""
import pytest
import torch

from ds_pipemorph.staging import StagingRing

CASES = [
    torch.tensor(3.5, dtype=torch.float32),  # 0-d
    torch.arange(17, dtype=torch.int64),  # 1-d
    torch.randn(2, 3, 5).to(torch.bfloat16),  # 3-d
    torch.tensor([True, False, True, True]),  # bool
    torch.empty(0, 4, dtype=torch.float32),  # empty
    torch.randn(4, 1, 2, dtype=torch.float32),
    torch.tensor(-7, dtype=torch.int64),  # 0-d int
    torch.zeros(3, 0, 2, dtype=torch.bool),  # empty 3-d
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@pytest.mark.timeout(300)
def test_dtypes_and_shapes_round_trip_in_fifo_order(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=4096, num_slots=len(CASES), op=staging_op) as ring:
        assert ring.occupancy() == 0 and ring.num_slots == len(CASES) and ring.slot_bytes == 4096
        for i, t in enumerate(CASES):
            ring.push(t, tag=100 + i, timeout_s=1.0)
        assert ring.occupancy() == len(CASES)
        for i, t in enumerate(CASES):
            got, tag = ring.pop(timeout_s=1.0)
            assert tag == 100 + i
            assert same(got, t), f"case {i}: {got!r} != {t!r}"
        assert ring.occupancy() == 0
        assert ring.try_pop() is None


@pytest.mark.timeout(300)
def test_wraps_around_many_times_and_pops_into_out(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=1024, num_slots=3, op=staging_op) as ring:
        out = torch.empty(8, dtype=torch.float32)
        for i in range(50):
            x = torch.full((2, 4), float(i))
            ring.push(x, tag=i, timeout_s=1.0)
            got, tag = ring.pop(timeout_s=1.0, out=out)
            assert tag == i and got.shape == (2, 4) and got.data_ptr() == out.data_ptr()
            assert torch.equal(got, x)
        assert ring.occupancy() == 0


@pytest.mark.timeout(300)
def test_non_contiguous_input_and_try_pop(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=4096, num_slots=2, op=staging_op) as ring:
        base = torch.arange(24, dtype=torch.int64).view(4, 6)
        ring.push(base.t(), tag=5)  # transposed view: pushed as a contiguous copy
        got = ring.try_pop()
        assert got is not None
        t, tag = got
        assert tag == 5 and torch.equal(t, base.t().contiguous()) and t.shape == (6, 4)
        assert ring.try_pop() is None


@pytest.mark.timeout(300)
def test_attach_sees_the_same_ring_and_creator_unlinks(staging_op, ring_name):
    import os

    ring = StagingRing.create(ring_name, slot_bytes=256, num_slots=2, op=staging_op)
    peer = StagingRing.attach(ring_name, timeout_s=1.0, op=staging_op)
    assert not peer.is_creator and peer.num_slots == 2 and peer.slot_bytes == 256
    ring.push(torch.tensor([1, 2, 3]), tag=9)
    assert peer.occupancy() == 1
    t, tag = peer.pop(timeout_s=1.0)
    assert tag == 9 and t.tolist() == [1, 2, 3]
    peer.close()
    assert os.path.exists(f"/dev/shm/{ring_name}")  # an attached end never unlinks
    ring.close()
    ring.close()  # idempotent
    assert ring.closed and not os.path.exists(f"/dev/shm/{ring_name}")


@pytest.mark.timeout(300)
def test_zero_copy_writing_and_reading(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=1024, num_slots=2, op=staging_op) as ring:
        with ring.writing(torch.bfloat16, (3, 4), tag=21) as view:
            assert view.dtype == torch.bfloat16 and view.shape == (3, 4)
            view.copy_(torch.arange(12, dtype=torch.bfloat16).view(3, 4))
        ring.push(torch.tensor([1, 2]), tag=22)
        with ring.reading(timeout_s=1.0) as (t, tag):
            assert tag == 21 and torch.equal(t, torch.arange(12, dtype=torch.bfloat16).view(3, 4))
            assert ring.occupancy() == 1  # claimed: only the second message is still waiting
        # A failing block puts the message back; the next read sees it again.
        with pytest.raises(KeyError), ring.reading(timeout_s=1.0) as (t, tag):
            assert tag == 22
            raise KeyError("delegate failed")
        assert ring.occupancy() == 1
        t, tag = ring.pop(timeout_s=1.0)
        assert tag == 22 and t.tolist() == [1, 2]
        # A failing write is not published.
        with pytest.raises(KeyError), ring.writing(torch.float32, (2,), tag=23):
            raise KeyError("recv failed")
        assert ring.occupancy() == 0 and ring.try_pop() is None
        with pytest.raises(ValueError, match="a slot holds at most 1024 bytes"), ring.writing(torch.float32, (257,)):
            pass
