"""The small model and batch both the torch pipelining run and the single-process reference use:
S stages of Linear(DIM, DIM) + ReLU, an MSE loss averaged over each micro-batch."""
import torch

DIM = 8
ROWS_PER_MICROBATCH = 3


def build_model(stages: int) -> list[torch.nn.Module]:
    torch.manual_seed(1234)
    return [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU()) for _ in range(stages)]


def batch(microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    n = microbatches * ROWS_PER_MICROBATCH
    return torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)
