"""The iteration boundary on two gloo ranks: every loop's row travels in one all-gather, and each
loop reads back exactly its own columns of every rank's row, in rank order; exchanges grow apart
while the loops are quiet, as ``control.exchange`` lays them out, the iterations between pass their
records to ``skip``, every iteration exchanges while a comparison runs, and ranks that meet in
exchanges of different iterations stop with a message."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_pipemorph.control.exchange import exchange_iterations
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


class Quiet(Loop):
    """Quiet after every exchange but those in ``changing``; keeps the records ``skip`` got."""

    def __init__(self, changing: set[int]):
        super().__init__(1, 0.0)
        self.changing, self.iteration, self.skipped = changing, -1, []

    def row(self, engine, records):
        self.iteration += 1
        return super().row(engine, records)

    def decide(self, engine, table, sync_ms, exchange_ms):
        return None

    def skip(self, engine, records):
        self.iteration += 1
        self.skipped.append(records)

    def quiet(self):
        return self.iteration > 0 and self.iteration not in self.changing


CHANGING = {7}
ITERATIONS = 20
COMPARED = 10  # iterations of a pipemorph.compare run


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
        got = {"first": first, "second": second, "gathers": len(calls)}

        del calls[:]
        loop = Quiet(CHANGING)
        spaced = Boundary([loop], lambda: group, max_gap=4)
        got["decisions"] = [spaced.exchange(None, [f"records of {i}"]) for i in range(ITERATIONS)]
        got.update(spaced_gathers=len(calls), exchanged=spaced.exchanged, skipped=loop.skipped)

        # While pipemorph.compare runs (until iteration 10 here) every iteration exchanges, quiet or not.
        del calls[:]
        engine = SimpleNamespace(compare=SimpleNamespace(done=False))
        comparing = Boundary([Quiet(set())], lambda: group, max_gap=4)
        for i in range(ITERATIONS):
            engine.compare.done = i >= COMPARED
            comparing.exchange(engine, [])
        got.update(compared=comparing.exchanged, compared_gathers=len(calls))

        # Rank 0 exchanges every iteration, rank 1 grows its gaps (0, 1, 3): they meet at iterations 2 and 3.
        apart = Boundary([Quiet(set())], lambda: group, max_gap=1 if rank == 0 else 8)
        try:
            for _ in range(4):
                apart.exchange(None, [])
        except RuntimeError as e:
            got["disagree"] = str(e)
        torch.save(got, f"{out}.{rank}")
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
        expected = exchange_iterations(ITERATIONS, lambda i: i > 0 and i not in CHANGING, max_gap=4)
        assert expected == [0, 1, 3, 7, 8, 10, 14, 18]  # not quiet at 0 (nothing seen) and at 7
        assert got["exchanged"] == expected and got["spaced_gathers"] == len(expected) < ITERATIONS
        assert got["decisions"] == [[None]] * ITERATIONS
        assert got["skipped"] == [[f"records of {i}"] for i in range(ITERATIONS) if i not in expected]
        # every iteration while comparing; from the first exchange after it, gaps 2 and 4 (max_gap 4)
        assert got["compared"] == [*range(COMPARED), COMPARED, COMPARED + 2, COMPARED + 6]
        assert got["compared_gathers"] == len(got["compared"])
        assert got["disagree"] == (f"rank {rank}: the control loops' exchange after iteration {2 + rank} met other "
                                   f"ranks after iterations [2, 3] (per rank): the ranks disagree on when the loops "
                                   f"exchange")


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
