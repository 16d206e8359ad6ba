"""A planner that raises on rank 0 while the control loop re-plans: rank 0 broadcasts the failure
instead of a plan, and every rank raises the same error (none is left waiting in the broadcast)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
from ds_pipemorph.procs import free_port
from ds_pipemorph.runtime.adapt import Adapter
from ds_pipemorph.runtime.overhead import Overhead

WORLD = 2


def _rank(rank: int, port: int, replan: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        S, N = 2, 4
        adapter = Adapter(S, N, rank, deepspeed_1f1b(S, N), Costs.uniform(S, 10.0), None, 1, {}, replan=replan)
        costs = Costs.uniform(S, 10.0)
        # The detector has seen a slow link: the policy plans now, on rank 0 only.
        adapter._raw_per_stage = lambda table: ([10.0] * S, [10.0] * S, [10.0] * S)
        adapter._link_delays = lambda table: [30.0]
        adapter.policy.observe = lambda *a, **k: costs

        def broken(*a, **k):
            raise ValueError("no plan fits")
        adapter.policy.react = adapter.policy.propose = broken
        try:
            adapter._decide(torch.zeros(WORLD, adapter.width), Overhead())
            out.put((rank, "returned"))
        except RuntimeError as e:
            out.put((rank, str(e)))
        adapter.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replan", ["inline", "background"])
def test_a_planner_failure_on_rank_0_is_raised_on_every_rank(replan):
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, replan, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=100) for _ in range(WORLD))
    finally:  # a rank left waiting in the broadcast is what this test catches: never leave it behind
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {r: "pipemorph: rank 0's planner failed while re-planning: ValueError: no plan fits"
                   for r in range(WORLD)}, got
