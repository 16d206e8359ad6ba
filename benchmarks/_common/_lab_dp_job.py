"""One 2 x 4 pipeline job in the network lab: 8 lab nodes, each running one rank under its own
``torchrun --nnodes 8 --node_rank k``; DeepSpeed's default placement puts stage s on ranks 2s and
2s + 1, so each data-parallel pair {2s, 2s + 1} joins two nodes and its all-reduce crosses their link.
``benchmarks/lab/lab_orchestrator.py`` runs it (the orchestrator on a real slow data-parallel link).

Each stage is the emulated stage of ``pipemorph bench`` (``inject.emulated.EmulatedStage``: F, B
and W take fixed times around tiny real math) next to a ballast parameter of ``ballast_mb`` MB that
takes part in the forward (its mean is added to the output), so each stage's all-reduce moves real
gradient bytes over the lab's real links; pipeline messages stay ``32 * act_rows`` bytes.

One job runs several rows (engine settings) one after the other, each on a fresh engine built by
``ds_pipemorph.initialize`` from the same seed and fed the same batches (replica d's batches to the
ranks of replica d, read from ``engine.grid.data_parallel_id`` every iteration, since a re-mapping
may change it). Per iteration it records the time from a barrier to the last rank's return from
``train_batch`` (a re-mapping the handle makes after that ``train_batch`` included), every rank's
coordinate and its ``ReduceGrads`` time (from the op records of the engine that ran the iteration),
and the loss; per row every re-mapping report, the orchestrator's decisions (rank 0) and every
stage's final parameters (gathered on rank 0). Rank 0 writes the results as JSON.

    python benchmarks/_common/_lab_dp_job.py SPEC.json      (the rank side: torchrun starts it in each node)

The launcher side is ``run_job(lab, spec, work)``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # after PYTHONPATH: a package earlier on the path is the one the job runs
    sys.path.append(str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lab_job import JobResult, read_progress, stop_nodes  # noqa: E402  (the launcher's side is shared)

STAGES, REPLICAS = 4, 2
NODES = STAGES * REPLICAS
WIDTH = 8


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    pipemorph: dict
    iterations: int = Field(ge=1)


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: list[Row] = Field(min_length=1)
    microbatches: int = Field(ge=1)
    op_ms: float = Field(gt=0)
    ballast_mb: float = Field(ge=0)  # MB of float32 ballast parameter per stage
    act_rows: int = Field(1, ge=1)
    timeout_s: float = Field(gt=0)
    out: str
    progress: str


def ballast_elements(mb: float) -> int:
    return int(round(mb * 1e6 / 4))


# --------------------------------------------------------------------------------------------------
# rank side


def _stage_class():
    import torch

    from ds_pipemorph.inject.emulated import EmulatedStage

    class BallastStage(torch.nn.Module):
        """EmulatedStage plus a ballast parameter of ``n`` float32 values whose mean is added to the
        output: its gradient is ``n`` real values the all-reduce moves."""

        def __init__(self, width: int, ms: float, n: int):
            super().__init__()
            self.stage = EmulatedStage(width, ms, ms, ms)
            self.ballast = torch.nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return self.stage(x) + self.ballast.mean()

    return BallastStage


def _build(spec: JobSpec, row: Row, cls):
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph

    torch.manual_seed(0)
    n = ballast_elements(spec.ballast_mb)
    model = PipelineModule(layers=[LayerSpec(cls, WIDTH, spec.op_ms, n) for _ in range(STAGES)],
                           num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec.microbatches,
           "train_batch_size": spec.microbatches * REPLICAS, "optimizer": {"type": "SGD", "params": {"lr": 1e-1}},
           "steps_per_print": 10**9,
           "pipemorph": {"nvtx": False, "timeout_s": spec.timeout_s, **row.pipemorph}}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _reduce_ms(records) -> float:
    return sum(r.end_ns - r.start_ns for r in records if r.op == "ReduceGrads") / 1e6


def _run_row(spec: JobSpec, row: Row, index: int, data, cls) -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    handle = _build(spec, row, cls)
    iters, remaps = [], []
    for i in range(row.iterations):
        ran_on = getattr(handle, "engine", handle)  # the engine in force (the handle may swap it afterwards)
        stage, replica = ran_on.stage_id, ran_on.grid.data_parallel_id
        n_remaps = len(getattr(handle, "remaps", []))
        dist.barrier()
        t0 = time.monotonic_ns()
        loss = handle.train_batch(iter(data[replica]))
        t1 = time.monotonic_ns()
        new = list(getattr(handle, "remaps", []))[n_remaps:]
        # A re-mapping runs at the end of the handle's train_batch: the iteration ended when it began.
        span = torch.tensor([-t0, t1 - round(sum(r.seconds for r in new) * 1e9)], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        mine = {"rank": rank, "stage": stage, "replica": replica, "reduce_ms": round(_reduce_ms(ran_on.op_records), 3),
                "loss": float(loss) if loss is not None else None,
                "remap": [{"ok": r.ok, "ms": round(r.seconds * 1e3, 1), "old": list(r.old), "new": list(r.new),
                           "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received, "reason": r.reason}
                          for r in new]}
        everyone = [None] * NODES
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            reduce_by_stage = [max(e["reduce_ms"] for e in everyone if e["stage"] == s) for s in range(STAGES)]
            grid = [[next(e["rank"] for e in everyone if e["stage"] == s and e["replica"] == d) for d in range(REPLICAS)]
                    for s in range(STAGES)]
            it = {"iteration": i, "ms": (span[0].item() + span[1].item()) / 1e6, "ranks": grid,
                  "allreduce_ms": reduce_by_stage, "per_rank": everyone,
                  "loss": next((e["loss"] for e in everyone if e["loss"] is not None), None),
                  "remap": [dict(r, rank=e["rank"]) for e in everyone for r in e["remap"]]}
            iters.append(it)
            if it["remap"]:
                remaps.append({"after_iteration": i, "reports": it["remap"]})
            with open(spec.progress, "a") as f:
                f.write(json.dumps({"row": index, "name": row.name, "iteration": i, "ms": it["ms"],
                                    "time": time.monotonic()}) + "\n")
    engine = getattr(handle, "engine", handle)
    decisions = []
    hook = getattr(engine, "orchestrate", None)
    if rank == 0 and hook is not None and hook.orchestrator is not None:
        decisions = [{"ranks": d.ranks, "current_ms": d.current_ms, "predicted_ms": d.predicted_ms,
                      "measured_allreduce_ms": d.measured_allreduce_ms,
                      "predicted_allreduce_ms": d.predicted_allreduce_ms, "iteration": d.iteration,
                      "overhead_ms": d.overhead_ms, "seconds": d.seconds}
                     for d in hook.orchestrator.decisions]
    mine = {"stage": engine.stage_id, "replica": engine.grid.data_parallel_id,
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    gathered = [None] * NODES if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    handle.destroy()
    dist.barrier()
    params = None
    if rank == 0:
        params = {(g["stage"], g["replica"]): g["params"] for g in gathered}
    return {"name": row.name, "pipemorph": row.pipemorph, "iterations": iters, "remaps": remaps,
            "decisions": decisions}, params


def _compare(a: dict, b: dict) -> dict:
    """Largest |difference| between two rows' parameters, per stage (both replicas), and between replicas."""
    out = {"per_stage": [], "replicas": []}
    for s in range(STAGES):
        diff = 0.0
        for d in range(REPLICAS):
            pa, pb = a[(s, d)], b[(s, d)]
            if sorted(pa) != sorted(pb):
                raise RuntimeError(f"stage {s}: parameters {sorted(pa)} vs {sorted(pb)}")
            diff = max(diff, max((pa[n] - pb[n]).abs().max().item() for n in pa))
        out["per_stage"].append(diff)
        out["replicas"].append(max((b[(s, 0)][n] - b[(s, 1)][n]).abs().max().item() for n in b[(s, 0)]))
    return out


def main(spec_path: str) -> None:
    from datetime import timedelta

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_pipemorph.fileio import load_model, write_atomic

    spec = load_model(spec_path, JobSpec)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=spec.timeout_s))
    rank = dist.get_rank()
    cls = _stage_class()
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(1, spec.act_rows, WIDTH, generator=g), torch.randn(1, spec.act_rows, WIDTH, generator=g))
             for _ in range(spec.microbatches)] for _ in range(REPLICAS)]
    results, params = [], []
    for k, row in enumerate(spec.rows):
        res, p = _run_row(spec, row, k, data, cls)
        results.append(res)
        params.append(p)
    if rank == 0:
        # Every row trains the same model on the same batches: each row's parameters against the first row's.
        for res, p in zip(results, params):
            res["params_vs_first_row"] = _compare(params[0], p)
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "rows": results}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# launcher side


def node_command(lab, k: int, script: str, args: list[str], port: int, work: Path) -> list[str]:
    """``torchrun`` for node ``k`` of an 8-node job (one rank per node), node 0 the master; its log
    folders in ``work``."""
    from ds_pipemorph.procs import torchrun

    return [*torchrun(work / f"torchrun{k}", "--nnodes", str(NODES), "--nproc_per_node", "1"),
            "--node_rank", str(k), "--master_addr", lab.addr(0), "--master_port", str(port), script, *args]


def node_env() -> dict:
    from ds_pipemorph.procs import versioned_extensions_dir

    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]),
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())}


def run_nodes(lab, commands: list[list[str]], logs: list[Path], timeout_s: float, progress: Optional[Path] = None,
              on_progress=lambda lines: None, extra_env: Optional[dict] = None) -> tuple[list, list[str], float]:
    """Start ``commands[k]`` in lab node k (gloo on the node's interface, ``extra_env`` over the
    job's environment), wait for all (killing what still runs after ``timeout_s``); (exit codes, logs, seconds)."""
    env = {**node_env(), **(extra_env or {})}
    procs = []
    t0 = time.monotonic()
    for k, cmd in enumerate(commands):
        with open(logs[k], "w") as log:
            procs.append(lab.popen(k, cmd, env={**env, **lab.node_env(k)}, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=str(REPO)))
    seen = 0
    try:
        while any(p.poll() is None for p in procs):
            if progress is not None:
                lines = read_progress(progress)
                if len(lines) > seen:
                    seen = len(lines)
                    on_progress(lines)
            if time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.2)
    finally:
        codes = stop_nodes(procs)
    return codes, [p.read_text(errors="replace") for p in logs], time.monotonic() - t0


def run_job(lab, spec: JobSpec, work: Path, port: int = 29651, timeout_s: float = 1800.0,
            on_progress=lambda lines: None) -> JobResult:
    """Run ``spec`` on the lab's nodes 0..7 (one rank each, node 0's address the master)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    commands = [node_command(lab, k, str(Path(__file__).resolve()), [str(spec_path)], port, work) for k in range(NODES)]
    logs = [work / f"node{k}.log" for k in range(NODES)]
    codes, texts, seconds = run_nodes(lab, commands, logs, timeout_s, Path(spec.progress), on_progress)
    out = Path(spec.out)
    results = json.loads(out.read_text()) if out.exists() else None
    return JobResult(codes, texts, results, seconds, read_progress(Path(spec.progress)))


if __name__ == "__main__":
    main(sys.argv[1])
