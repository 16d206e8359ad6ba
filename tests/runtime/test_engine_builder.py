"""What an engine can be rebuilt from (``runtime.engine_builder.EngineBuilder``): re-mapping refuses, in one
sentence, the inputs it cannot make anew for new parameters. The rebuild itself runs in
test_remap.py and test_orchestrate.py, on real ranks."""
from __future__ import annotations

import torch

from ds_pipemorph.runtime.engine_builder import EngineBuilder
from ds_pipemorph.runtime.initialize import build_engine


def test_optimizer_and_scheduler_from_the_config_or_a_callable_can_be_rebuilt():
    assert EngineBuilder(build_engine, config={"train_batch_size": 4}).refusal() is None
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    make_sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)  # noqa: E731
    assert EngineBuilder(build_engine, optimizer=make_opt, lr_scheduler=make_sched).refusal() is None


def test_an_optimizer_or_scheduler_object_or_a_data_loader_is_refused_by_name():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert EngineBuilder(build_engine, optimizer=opt).refusal() == (
        "re-mapping cannot rebuild a client optimizer object for new parameters: give it in the DeepSpeed "
        "config or as a callable")
    assert "client lr_scheduler object" in EngineBuilder(build_engine, lr_scheduler=sched).refusal()
    assert "cannot carry a DeepSpeed data loader's position" in EngineBuilder(
        build_engine, training_data=[torch.zeros(2)]).refusal()
