"""The iteration's loss as ``runtime.train_loss`` makes it: stock DeepSpeed's bits, and the early
broadcast only where every rank of a pipeline can tell without talking.

(Multi-rank: ``test_equivalence.py`` checks every rank's returned loss against stock DeepSpeed, with
the early broadcast on one replica and stock's reduction on two.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from ds_pipemorph.runtime.train_loss import broadcasts_early, sum_in_order


def test_the_sum_has_the_bits_of_stocks_running_total():
    g = torch.Generator().manual_seed(3)
    losses = [torch.rand((), generator=g) * 10 ** torch.randint(-3, 4, (), generator=g) for _ in range(16)]
    running = None  # PipelineEngine._exec_forward_pass, per micro-batch
    for loss in losses:
        running = loss.detach().clone() if running is None else running + loss.detach()
    assert torch.equal(sum_in_order(losses), running)
    assert torch.equal(sum_in_order(losses[:1]), losses[0])


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
