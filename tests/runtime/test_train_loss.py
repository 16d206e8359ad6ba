"""The iteration's loss as ``runtime.train_loss`` makes it: stock DeepSpeed's bits, and the early
broadcast only where every rank of a pipeline can tell without talking.

(Multi-rank: ``test_equivalence.py`` checks every rank's returned loss against stock DeepSpeed, with
the early broadcast on one replica and stock's reduction on two.)"""
from __future__ import annotations

import os
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from ds_pipemorph.runtime.train_loss import EarlyLoss, broadcasts_early, sum_in_order


def _stock_total(losses):
    """DeepSpeed 0.19.8's PipelineEngine._exec_forward_pass (add_to_total_loss), one loss per forward."""
    total = None
    for loss in losses:
        if total is None:
            total = torch.zeros_like(loss)
        total += loss.detach()
    return total


def test_the_sum_has_the_bits_of_stocks_running_total():
    g = torch.Generator().manual_seed(3)
    signs = torch.tensor([1.0, -1.0])
    losses = [signs[torch.randint(0, 2, (), generator=g)] * torch.rand((), generator=g)
              * 10.0 ** torch.randint(-3, 4, (), generator=g).item() for _ in range(16)]
    for case in (losses, losses[:1], [torch.tensor(-0.0)] * 3, [torch.tensor(1e8), torch.tensor(1.0), torch.tensor(-1e8)]):
        ours, stock = sum_in_order(case), _stock_total(case)
        assert torch.equal(ours, stock) and torch.equal(ours.signbit(), stock.signbit()), (case, ours, stock)


class _WithExtraLosses(PipelineModule):
    def get_additional_losses(self):
        return {"aux": torch.zeros(())}


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo group, gone after the test (other tests start their own)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _engine(module_cls=PipelineModule, pipe=True, data=False, group=None):
    module = module_cls.__new__(module_cls)  # only its class is read
    return SimpleNamespace(module=module, is_pipe_parallel=pipe, is_data_parallel=data,
                           grid=SimpleNamespace(get_pipe_parallel_group=lambda: group))


@pytest.mark.timeout(60)
def test_the_broadcast_starts_early_on_one_gloo_replica_whose_module_adds_no_losses(gloo_group):
    assert broadcasts_early(_engine(group=gloo_group))
    assert not broadcasts_early(_engine(data=True, group=gloo_group))  # stock averages over replicas first
    assert not broadcasts_early(_engine(pipe=False, group=gloo_group))  # nothing to broadcast
    assert not broadcasts_early(_engine(_WithExtraLosses, group=gloo_group))  # their number sizes the message


@pytest.mark.timeout(60)
def test_a_loss_broadcast_left_pending_by_a_failed_batch_stops_the_next_one(gloo_group):
    engine = SimpleNamespace(grid=SimpleNamespace(get_pipe_parallel_group=lambda: gloo_group),
                             _loss_stage_global_rank=lambda: 0, global_rank=0,
                             pipemorph=SimpleNamespace(timeout_s=30.0))
    loss = EarlyLoss(engine)
    loss.send(torch.tensor(2.5))  # the one rank is the last stage: its loss goes out ...
    assert [t.item() for t in loss.collect()] == [2.5, 2.5]  # ... and comes back as stock's two values
    loss.send(torch.tensor(1.0))  # a batch that fails before collecting
    with pytest.raises(RuntimeError, match="^the previous train_batch failed before it collected its loss"):
        loss.send(torch.tensor(3.0))
    with pytest.raises(RuntimeError, match="^the previous train_batch failed before it collected its loss"):
        loss.post(torch.device("cpu"))


def _wait_for_a_loss_never_sent(rank: int, store_path: str, out: str) -> None:
    """Rank 1 of two waits for the last stage's loss; rank 0, the last stage, never sends it."""
    import torch.distributed as dist
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1:
        engine = SimpleNamespace(grid=SimpleNamespace(get_pipe_parallel_group=lambda: dist.group.WORLD),
                                 _loss_stage_global_rank=lambda: 0, global_rank=1,
                                 pipemorph=SimpleNamespace(timeout_s=1.0))
        loss = EarlyLoss(engine)
        loss.post(torch.device("cpu"))
        try:
            loss.collect()
            result = "returned"
        except Exception as e:  # noqa: BLE001 - the test reads its type and text
            result = f"{type(e).__name__}: {e}"
        Path(out).write_text(result)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])
    os._exit(0)  # the broadcast rank 1 gave up on is still posted: leave without tearing the group down


@pytest.mark.timeout(120)
def test_collecting_a_loss_that_never_comes_is_a_timeout_not_a_hang(tmp_path):
    import torch.multiprocessing as mp
    out = tmp_path / "result.txt"
    mp.start_processes(_wait_for_a_loss_never_sent, args=(str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method="spawn")
    assert out.read_text() == ("TransportTimeout: rank 1: timed out after 1 s waiting for the iteration's loss "
                               "from the last stage")
