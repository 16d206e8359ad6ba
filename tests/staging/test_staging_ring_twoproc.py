"""A spawned producer process pushes 200 messages of random sizes; this process pops and checks every byte."""
import multiprocessing as mp

import pytest
import staging_workers
import torch

from ds_pipemorph.staging import StagingRing

COUNT = 200
SLOT_BYTES = 64 * 1024


def pop_while_alive(ring, producer, limit_s=120.0):
    """pop(), but fail at once (with the exit code) if the producer died instead of waiting for the timeout."""
    for _ in range(int(limit_s)):
        try:
            return ring.pop(timeout_s=1.0)
        except TimeoutError:
            assert producer.is_alive() or ring.occupancy() > 0, f"producer exited with {producer.exitcode}"
    raise AssertionError(f"no message within {limit_s} s")


@pytest.mark.timeout(600)
def test_two_processes_200_random_messages(staging_op, ring_name):
    ctx = mp.get_context("spawn")
    # 4 small slots: the producer wraps around ~50 times and regularly waits for the consumer.
    with StagingRing.create(ring_name, slot_bytes=SLOT_BYTES, num_slots=4, op=staging_op) as ring:
        producer = ctx.Process(target=staging_workers.produce, args=(ring_name, COUNT, SLOT_BYTES))
        producer.start()
        try:
            sizes = []
            for i in range(COUNT):
                got, tag = pop_while_alive(ring, producer)
                want = staging_workers.message(i, SLOT_BYTES)
                assert tag == 10_000 + i, f"message {i}: tag {tag}"
                assert got.dtype == want.dtype and got.shape == want.shape, f"message {i}: {got.dtype}{got.shape}"
                assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
                    f"message {i}: payload bytes differ"
                )
                sizes.append(want.numel() * want.element_size())
            assert ring.try_pop() is None and ring.occupancy() == 0
        finally:
            producer.join(timeout=60)
            if producer.is_alive():
                producer.kill()
        assert producer.exitcode == 0
    assert 0 in sizes and SLOT_BYTES in sizes and len(set(sizes)) > 150
