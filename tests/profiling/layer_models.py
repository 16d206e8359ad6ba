"""Tiny models for the per-layer profiler tests: Linear layers of two widths 32x apart."""
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

BATCH, NARROW, WIDE = 128, 64, 2048


def layers():
    """narrow -> narrow, narrow -> wide, ReLU (a function without parameters), wide -> narrow."""
    return [LayerSpec(torch.nn.Linear, NARROW, NARROW), LayerSpec(torch.nn.Linear, NARROW, WIDE), torch.relu,
            LayerSpec(torch.nn.Linear, WIDE, NARROW)]


def two_widths():
    """The layers as a 2-stage PipelineModule with an MSE loss."""
    return PipelineModule(layers=layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                          partition_method="uniform")


def layer_list():
    """The same layers as a plain list (no stage count of its own)."""
    return layers()


def sample():
    """One micro-batch as DeepSpeed's data iterator yields it: (inputs, labels)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, NARROW, generator=g), torch.randn(BATCH, NARROW, generator=g)
