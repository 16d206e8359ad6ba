"""Tiny pipeline models and data for the runtime tests (a few Linear/GELU layers per stage)."""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

WIDTH = 16


class IdleHeadLinear(torch.nn.Linear):
    """A Linear with one more parameter its forward never uses (an idle head): no gradient reaches it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.idle = torch.nn.Parameter(torch.ones(WIDTH))


def mlp_layers(stages: int, per_stage: int = 2, tied: bool = False, dropout: float = 0.0, idle: bool = False) -> list:
    """``idle``: every Linear also holds a parameter without a gradient (``IdleHeadLinear``)."""
    layers = []
    if tied:  # the same Linear at both ends of the pipeline (first and last stage)
        layers.append(TiedLayerSpec("ends", torch.nn.Linear, WIDTH, WIDTH))
    for _ in range(stages * per_stage):
        layers += [LayerSpec(IdleHeadLinear if idle else torch.nn.Linear, WIDTH, WIDTH), torch.nn.GELU()]
        if dropout:
            layers.append(LayerSpec(torch.nn.Dropout, dropout))
    if tied:
        layers.append(TiedLayerSpec("ends", torch.nn.Linear, WIDTH, WIDTH))
    return layers


def build_model(stages: int, seed: int, tied: bool = False, dropout: float = 0.0, idle: bool = False) -> PipelineModule:
    """With ``dropout``, a Dropout after every GELU and DeepSpeed's ``seed_layers``: each layer's random
    numbers are seeded by its index and the forward count, whatever stage runs it."""
    torch.manual_seed(seed)
    return PipelineModule(layers=mlp_layers(stages, tied=tied, dropout=dropout, idle=idle), num_stages=stages,
                          loss_fn=torch.nn.MSELoss(), partition_method="uniform", seed_layers=bool(dropout))


def batches(n: int, micro_batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro_batch_size, WIDTH, generator=g), torch.randn(micro_batch_size, WIDTH, generator=g))
            for _ in range(n)]


def ds_config(micro_batches: int, dp: int = 1, micro_batch_size: int = 2, pipemorph: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "steps_per_print": 10**9,
    }
    if pipemorph is not None:
        cfg["pipemorph"] = pipemorph
    return cfg
