"""Tiny models for the stage profiler tests: stages whose sizes differ by a large factor."""
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

WIDTH = 64


class Mlp(torch.nn.Module):
    """width -> hidden -> width with a residual, so its cost grows with ``hidden``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, hidden)
        self.down = torch.nn.Linear(hidden, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def pipe_two_stages():
    """A 2-stage PipelineModule (uniform partition): stage 1's layers are 32x wider than stage 0's."""
    layers = [LayerSpec(Mlp, 64), LayerSpec(Mlp, 64), LayerSpec(Mlp, 2048), LayerSpec(Mlp, 2048)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                          partition_method="uniform")


def stage_list():
    """Three per-stage modules, each 8x wider than the one before."""
    return [torch.nn.Sequential(Mlp(h), Mlp(h)) for h in (32, 256, 2048)]


def sample():
    """One micro-batch as DeepSpeed's data iterator yields it: (inputs, labels)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)


def not_a_model():
    return 42
