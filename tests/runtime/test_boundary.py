"""The iteration boundary on two gloo ranks: every loop's row travels in one all-gather, and each
loop reads back exactly its own columns of every rank's row, in rank order."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_pipemorph.runtime.boundary import Boundary

pytestmark = pytest.mark.timeout(120)
WORLD = 2


class Loop:
    """A loop whose row is ``base + 10 * rank + column`` and whose decision is the table it read."""

    def __init__(self, width: int, base: float):
        self.width, self.base = width, base

    def row(self, engine, records):
        return [self.base + 10 * dist.get_rank() + c for c in range(self.width)]

    def decide(self, engine, table, sync_ms, exchange_ms):
        assert sync_ms >= 0 and exchange_ms >= 0
        return table.tolist()


def _worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=WORLD)
    calls = []
    gather = dist.all_gather

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather = counted
    try:
        group = dist.new_group(backend="gloo")
        boundary = Boundary([Loop(2, 100.0), Loop(3, 500.0)], lambda: group)
        first, second = boundary.exchange(None, [])
        torch.save({"first": first, "second": second, "gathers": len(calls)}, f"{out}.{rank}")
    finally:
        dist.all_gather = gather
        dist.destroy_process_group()


def test_one_gather_carries_every_loops_row(tmp_path):
    out = str(tmp_path / "boundary")
    mp.start_processes(_worker, args=(out,), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        got = torch.load(f"{out}.{rank}")
        assert got["gathers"] == 1
        assert got["first"] == [[100.0 + 10 * r + c for c in range(2)] for r in range(WORLD)]
        assert got["second"] == [[500.0 + 10 * r + c for c in range(3)] for r in range(WORLD)]


def test_no_loop_no_collective():
    assert Boundary([], lambda: pytest.fail("no group is formed without a loop")).exchange(None, []) == []


def test_a_row_of_the_wrong_width_is_refused_before_any_collective():
    class Short(Loop):
        def row(self, engine, records):
            return [0.0] * 3

    short = Short(4, 0.0)  # says 4 floats, gives 3: the all-gather would hang every rank
    boundary = Boundary([short], lambda: pytest.fail("no collective for a malformed row"))
    with pytest.raises(RuntimeError, match=r"Short gave a boundary row of shape \(3,\), not \(4,\)"):
        boundary.exchange(None, [])
