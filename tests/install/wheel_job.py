"""A 2-stage PipeMorph job run from an installed ds_pipemorph (the install test copies this file out of
the repository and runs it with the virtual environment's python under torchrun).

    torchrun --standalone --nproc_per_node 2 wheel_job.py OUT_DIR

It trains the same tiny model from the same seed twice, with ``delegation: off`` (DeepSpeed p2p) and
with ``delegation: always`` (every message through the staging ring and delegate processes), and
writes OUT_DIR/rank<r>.json: both runs' losses, the messages sent through delegates per link, where
ds_pipemorph and the staging op's sources were found, and which staging library the process mapped.
"""
from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule

import ds_pipemorph
from ds_pipemorph.staging.builder import StagingRingBuilder, cuda_ext_dir

WIDTH, N, STEPS, MBS = 16, 4, 3, 2


def model() -> PipelineModule:
    torch.manual_seed(1234)
    layers = []
    for _ in range(4):
        layers += [LayerSpec(torch.nn.Linear, WIDTH, WIDTH), torch.nn.GELU()]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")


def train(mode: str) -> tuple[list[float], dict]:
    m = model()
    cfg = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": N,
        "train_batch_size": MBS * N,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "steps_per_print": 10**9,
        "pipemorph": {"schedule": "zb", "delegation": {"mode": mode}},
    }
    engine, _, _, _ = ds_pipemorph.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    g = torch.Generator().manual_seed(99)
    data = iter([(torch.randn(MBS, WIDTH, generator=g), torch.randn(MBS, WIDTH, generator=g))
                 for _ in range(N * STEPS)])
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    sent = {str(k): v for k, v in engine.transport.delegated.sent.items()}
    engine.transport.close()
    return losses, sent


def mapped_staging_library() -> list[str]:
    name = f"/{StagingRingBuilder().name}.so"
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if line.rstrip().endswith(name)})


def main() -> int:
    out_dir = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    try:
        off, sent_off = train("off")
        always, sent_always = train("always")
        record = {"losses_off": off, "losses_always": always, "sent_off": sent_off, "sent_always": sent_always,
                  "package": ds_pipemorph.__file__, "sources": str(cuda_ext_dir()),
                  "builder_sources": StagingRingBuilder().sources(), "library": mapped_staging_library(),
                  "cwd": os.getcwd()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
