"""Timeouts, oversize messages and misuse give clear errors and leave the ring intact."""
import os
import re
import signal
import threading
import time

import pytest
import torch

from ds_pipemorph.staging import StagingRing


@pytest.mark.timeout(300)
def test_pop_timeout_names_ring_slot_and_duration_without_burning_cpu(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=64, num_slots=2, op=staging_op) as ring:
        t0, c0 = time.monotonic(), time.process_time()
        with pytest.raises(TimeoutError) as err:
            ring.pop(timeout_s=1.0)
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        msg = str(err.value)
        assert ring_name in msg and "slot 0 of 2" in msg and "1 s" in msg and "message 0" in msg, msg
        assert wall >= 1.0  # it waited its whole timeout (the test's timeout bounds it from above)
        assert cpu < 0.3 * wall, f"waiting used {cpu:.2f} s of CPU in {wall:.2f} s: busy loop?"
        # The ring still works after a timeout.
        ring.push(torch.tensor([4]), tag=1)
        assert ring.pop(timeout_s=1.0)[1] == 1


@pytest.mark.timeout(300)
def test_push_timeout_when_full(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=64, num_slots=2, op=staging_op) as ring:
        ring.push(torch.ones(2), tag=0)
        ring.push(torch.ones(2), tag=1)
        with pytest.raises(TimeoutError, match=r"free slot .*slot 0 of 2 is still FULL.*message 2 was not pushed"):
            ring.push(torch.ones(2), tag=2, timeout_s=0.2)
        assert ring.occupancy() == 2
        assert [ring.pop(timeout_s=1.0)[1] for _ in range(2)] == [0, 1]


@pytest.mark.timeout(300)
def test_oversize_is_refused_not_truncated(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=100, num_slots=2, op=staging_op) as ring:
        ring.push(torch.zeros(25, dtype=torch.float32), tag=1)  # exactly 100 bytes fits
        with pytest.raises(ValueError, match=r"cannot push 104 bytes .* a slot holds at most 100 bytes"):
            ring.push(torch.zeros(26, dtype=torch.float32), tag=2, timeout_s=0.0)
        assert ring.occupancy() == 1
        t, tag = ring.pop(timeout_s=1.0)
        assert tag == 1 and t.numel() == 25
        assert ring.try_pop() is None


@pytest.mark.timeout(300)
def test_mismatched_out_leaves_message_in_ring(staging_op, ring_name):
    with StagingRing.create(ring_name, slot_bytes=256, num_slots=2, op=staging_op) as ring:
        ring.push(torch.arange(6, dtype=torch.int64).view(2, 3), tag=3)
        with pytest.raises(ValueError, match=re.escape("cannot receive message 0") + ".*stays in the ring"):
            ring.pop(timeout_s=1.0, out=torch.empty(6, dtype=torch.float32))
        t, tag = ring.pop(timeout_s=1.0, out=torch.empty(6, dtype=torch.int64))
        assert tag == 3 and t.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.timeout(300)
def test_attach_missing_create_existing_and_closed(staging_op, ring_name):
    with pytest.raises(TimeoutError, match=r"cannot attach staging ring .* it does not exist"):
        StagingRing.attach(ring_name, timeout_s=0.2, op=staging_op)
    with StagingRing.create(ring_name, slot_bytes=64, op=staging_op) as ring:
        with pytest.raises(RuntimeError, match="a ring of that name exists"):
            StagingRing.create(ring_name, slot_bytes=64, op=staging_op)
        ring.close()
        with pytest.raises(RuntimeError, match="closed staging ring"):
            ring.push(torch.ones(1))
    with pytest.raises(ValueError, match="not usable"):
        StagingRing.create("a/b", slot_bytes=64, op=staging_op)
    assert not os.path.exists(f"/dev/shm/{ring_name}")


class Interrupted(Exception):
    pass


@pytest.mark.timeout(300)
def test_a_signal_interrupts_an_endless_pop(staging_op, ring_name):
    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        with StagingRing.create(ring_name, slot_bytes=64, op=staging_op) as ring:
            t0 = time.monotonic()
            timer.start()
            with pytest.raises(Interrupted):
                ring.pop(timeout_s=None)  # no timeout: only the signal ends the wait
            assert time.monotonic() - t0 >= 0.3  # ended by the signal, not before it
            ring.push(torch.ones(1), tag=5)  # the ring is still usable
            assert ring.pop(timeout_s=1.0)[1] == 5
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(300)
def test_a_ring_without_room_in_dev_shm_raises_its_own_type(staging_op, ring_name):
    """A ring /dev/shm cannot hold is refused with ``StagingNoRoomError`` (a RuntimeError), the type
    the delegated transport turns into advice on ``delegation.slot_mb`` / ``slots``, and leaves no file."""
    with pytest.raises(staging_op.StagingNoRoomError, match=r"cannot size staging ring .* large enough") as e:
        StagingRing.create(ring_name, slot_bytes=1 << 40, num_slots=64, op=staging_op)
    assert isinstance(e.value, RuntimeError)
    assert not os.path.exists(f"/dev/shm/{ring_name}")
