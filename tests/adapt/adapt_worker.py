"""Runs the adaptive engine on an emulated 4-stage pipeline while the test changes a link's delay.

    python tests/runtime/forkrun.py 4 tests/adapt/adapt_worker.py SPEC.json OUT_DIR

SPEC.json holds one spec, or {"runs": {"<name>": SPEC, ...}}: the runs one after another in the same
ranks (one job start for several tests), each on engines of its own.
SPEC: {"iterations": K, "delays": {"<iteration>": [ms per link], ...}, "op_ms": t, "microbatches": N},
optionally "replan" and "search_evals" (the adapt settings), "max_exchange_gap", "stock": false (skip the stock run),
"max_iterations": M (the adaptive run goes on past K while a re-plan search runs, up to M iterations).
The delay injector is put around the engine's transport by this worker (test control only); the
engine's control loop sees nothing but its own measurements. Also trains stock DeepSpeed on the
same data so the test can compare parameters. Writes OUT_DIR/adapt.rank<r>.json for one spec,
OUT_DIR/<name>.rank<r>.json for each of several runs (after each run, as it ends).
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.inject.emulated import EmulatedStage  # noqa: E402
from ds_pipemorph.inject.delays import DelaySchedule, install_delays  # noqa: E402


def build(spec, adaptive: bool):
    torch.manual_seed(0)
    t = spec["op_ms"]
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(4)], num_stages=4,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec["microbatches"],
           "train_batch_size": spec["microbatches"], "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "gradient_clipping": 1.0, "steps_per_print": 10**9}
    if not adaptive:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine
    cfg["pipemorph"] = {"schedule": "adaptive", "memory": {"max_inflight": [8, 6, 4, 2]},
                        "delegation": {"mode": spec.get("delegation", "off")}, "nvtx": False,
                        "adapt": {"replan": spec.get("replan", "background"),
                                  "search_evals": spec.get("search_evals", 2000)}}
    if "max_exchange_gap" in spec:
        cfg["pipemorph"]["max_exchange_gap"] = spec["max_exchange_gap"]
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def fork_server() -> bool:
    """Whether this rank runs the fork server its delegates come from (a child process)."""
    for child in psutil.Process().children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                return True
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return False


def main(spec_path: str, out_dir: str) -> None:
    spec = json.load(open(spec_path))
    runs = spec["runs"] if "runs" in spec else {"adapt": spec}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for name, run_spec in runs.items():
        results = run(run_spec)
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
    dist.destroy_process_group()


def run(spec: dict) -> dict:
    """Adaptive (and unless ``"stock": false``, stock DeepSpeed) trained on the spec's data: what each recorded."""
    g = torch.Generator().manual_seed(1)
    most = max(spec["iterations"], spec.get("max_iterations", 0))
    data = [[(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(spec["microbatches"])]
            for _ in range(most)]
    results = {}
    for name in ("adaptive", "stock") if spec.get("stock", True) else ("adaptive",):
        engine = build(spec, name == "adaptive")
        sched = None
        if name == "adaptive":  # the delay schedule both paths of every link read (test control only)
            sched = DelaySchedule([0.0, 0.0, 0.0])
            at_start = str(engine.adapter.policy.direct_model)  # as the engine chose it for its own transport
            install_delays(engine, sched)
        losses, modes, seconds, searching, servers, rising = [], [], [], [], [], []
        it = 0
        # Every rank learns at the same boundary whether the search still runs: all stop together.
        while it < spec["iterations"] or (sched is not None and it < most and engine.adapter._pending is not None):
            if sched is not None and str(it) in spec["delays"]:
                sched.static = list(spec["delays"][str(it)])
            t = time.perf_counter()
            losses.append(float(engine.train_batch(iter(data[it]))))
            seconds.append(time.perf_counter() - t)
            if sched is not None:
                modes.append([engine.transport.link_mode(i) for i in range(3)])
                searching.append(engine.adapter._pending is not None)  # a re-plan search still runs beside training
                servers.append(fork_server())
                rising.append(engine.adapter.policy.detector.rising)  # links counting slow iterations
            it += 1
        out = {"losses": losses, "params": {k: v.detach().clone().tolist() for k, v in engine.module.state_dict().items()}}
        if name == "adaptive":
            out["replans"] = [vars(r) for r in engine.adapter.replans]
            out["direct_model"] = {"at_start": at_start, "injected": str(engine.adapter.policy.direct_model)}
            out["measured"] = engine.adapter.measured
            out["exchanges"] = engine.boundary.exchanged
            out["modes"] = modes
            out["seconds"] = seconds
            out["searching"] = searching
            out["servers"] = servers
            out["rising"] = rising
            engine.transport.wait_sends()
            engine.destroy()
        results[name] = out
        dist.barrier()
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
