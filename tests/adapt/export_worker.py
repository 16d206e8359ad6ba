"""Trains the adaptive engine on an emulated 3-stage pipeline with ``profile_out`` and a slow link.

    python tests/runtime/forkrun.py 3 tests/adapt/export_worker.py SPEC.json OUT_DIR

SPEC: {"iterations": K, "op_ms": t, "microbatches": N, "links_ms": [ms per link]}. The delay is
injected through ``pipemorph.inject`` (testing only; the control loop never reads it). Rank 0 copies
``profile_out`` as it was right after the first re-plan (OUT_DIR/profile.replan.yaml) and writes
OUT_DIR/export.json: re-plans, measured delays and the profiler's overhead report. The final
``profile_out`` is written by ``engine.destroy()``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.inject.emulated import EmulatedStage  # noqa: E402


def main(spec_path: str, out_dir: str) -> None:
    spec = json.load(open(spec_path))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    stages, t, n = len(spec["links_ms"]) + 1, spec["op_ms"], spec["microbatches"]
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(stages)], num_stages=stages,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    profile_out = os.path.join(out_dir, "profile.yaml")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": n, "train_batch_size": n,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "pipemorph": {"schedule": "adaptive", "delegation": {"mode": "off"}, "nvtx": False,
                         "profile_out": profile_out,
                         "inject": {"links": {str(i): {"delay_ms": c} for i, c in enumerate(spec["links_ms"]) if c}}}}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(n)]
    copied = False
    for _ in range(spec["iterations"]):
        engine.train_batch(iter(data))
        if rank == 0 and engine.adapter.replans and not copied:
            shutil.copy(profile_out, os.path.join(out_dir, "profile.replan.yaml"))
            copied = True
    report = engine.adapter.overhead_report()
    result = {"replans": [vars(r) for r in engine.adapter.replans], "measured": engine.adapter.measured,
              "overhead": report, "own": [vars(o) for o in engine.adapter.overheads],
              "exchanges": engine.boundary.exchanged}
    engine.destroy()
    if rank == 0:
        with open(os.path.join(out_dir, "export.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
