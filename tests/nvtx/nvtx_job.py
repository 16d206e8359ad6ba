"""Trains a small pipeline with PipeMorphEngine under torchrun; each rank writes who it is and its op records.

    torchrun --standalone --nproc_per_node S*DP tests/nvtx/nvtx_job.py OUT_DIR STAGES DP MICRO_BATCHES STEPS [DISPATCH]

Per rank: OUT_DIR/rank<r>.json = {rank, stage, replica (DeepSpeed's data-parallel id), pid,
records: one list per train_batch of [op, start_ns, end_ns] (time.monotonic_ns)}. Started with
an NVTX injection library in the environment, the same process also records its NVTX ranges.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "runtime")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_pipemorph  # noqa: E402
from models import batches, build_model, ds_config  # noqa: E402


def main() -> int:
    out_dir, S, dp, N, steps = sys.argv[1], *map(int, sys.argv[2:6])
    dispatch = sys.argv[6] if len(sys.argv) > 6 else "ordered"
    deepspeed.init_distributed(dist_backend="gloo")
    section = {"schedule": "zb", "adapt": {"enabled": False}, "delegation": {"mode": "off"}, "nvtx": True,
               "timeout_s": 120, "dispatch": dispatch}
    model = build_model(S, seed=1234)
    engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(),
                                              config=ds_config(N, dp=dp, pipemorph=section))
    it = iter(batches(N * steps, 2, seed=99 + engine.grid.data_parallel_id))
    records = []
    for _ in range(steps):
        engine.train_batch(it)
        records.append([list(r) for r in engine.op_records])
    rank = dist.get_rank()
    me = {"rank": rank, "stage": engine.stage_id, "replica": engine.grid.data_parallel_id, "pid": os.getpid(),
          "nvtx_active": engine.recorder.nvtx_active, "records": records}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(me, f)
    engine.transport.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Ended as ``runtime.shutdown`` advises, without the interpreter's teardown: a gloo thread still
    # alive then can abort a process after its work is done ("terminate called without an active
    # exception"), which this 4-rank job did now and then although every rank had finished.
    from ds_pipemorph.runtime.shutdown import exit_process

    exit_process(main())
