"""Trains an emulated 4-stage pipeline once per run, each run with its own ``pipemorph.inject`` section.

    python tests/runtime/forkrun.py 4 tests/inject/compute_worker.py SPEC.json OUT_DIR

SPEC: {"op_ms": t, "microbatches": N, "runs": [{"name": ..., "iterations": K, "inject": {...}}, ...]}; a run
refused at start-up (PipeMorphConfigError) records its sentence as {"error": ...}.
Every run starts from the same parameters and trains on the same data with the same fixed plan (zb, no
re-planning, every link direct). Writes OUT_DIR/compute.rank<r>.json: per run the losses, the
parameters, and per iteration this rank's F/B/W durations from its OpRecords.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.runtime.config import PipeMorphConfigError  # noqa: E402
from ds_pipemorph.inject.compute import ComputeInjector  # noqa: E402
from ds_pipemorph.inject.emulated import EmulatedStage  # noqa: E402


def build(spec: dict, inject: dict):
    torch.manual_seed(0)
    t = spec["op_ms"]
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(4)], num_stages=4,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec["microbatches"],
           "train_batch_size": spec["microbatches"], "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "pipemorph": {"schedule": "zb", "adapt": {"enabled": False}, "delegation": {"mode": "off"},
                         "nvtx": False, "inject": inject}}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def main(spec_path: str, out_dir: str) -> None:
    spec = json.load(open(spec_path))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    iterations = max(run["iterations"] for run in spec["runs"])
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(spec["microbatches"])]
            for _ in range(iterations)]
    results = {}
    for run in spec["runs"]:
        try:
            engine = build(spec, run["inject"])
        except PipeMorphConfigError as e:  # refused at engine start: the sentence is the result
            results[run["name"]] = {"error": str(e)}
            dist.barrier()
            continue
        losses, ops = [], []
        for it in range(run["iterations"]):
            losses.append(float(engine.train_batch(iter(data[it]))))
            ops.append([[r.op, (r.end_ns - r.start_ns) / 1e6] for r in engine.op_records
                        if r.op[:1] in "FBW" and r.op[1:].isdigit()])
        hooks = engine.hooks.items if engine.hooks is not None else ()
        inj = next((h for h in hooks if isinstance(h, ComputeInjector)), None)
        results[run["name"]] = {
            "losses": losses, "ops": ops, "stage": engine.stage_id,
            "params": {k: v.detach().clone().tolist() for k, v in engine.module.state_dict().items()},
            "injector": None if inj is None else {"iterations": inj.iteration + 1, "injected_s": inj.injected_s},
        }
        engine.transport.wait_sends()
        engine.destroy()
        dist.barrier()
    with open(os.path.join(out_dir, f"compute.rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
