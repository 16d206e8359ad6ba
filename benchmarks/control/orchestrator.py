"""The orchestrator (PipeMorph §6, Fig. 19) on 8 CPU ranks: a slow link that data-parallel traffic
crosses, moved into the pipeline and absorbed there.

2 data-parallel replicas x 4 stages, 12 micro-batches, emulated stages (F = B = W = 10 ms around tiny
real math), the real engine. The 8 ranks form two halves, the even and the odd ranks, joined by a
slow link: every pair across it pays 30 ms one way (``inject.rank_links``: on a pipeline link per
message; on an all-reduce ring once per message of each of its 2(D - 1) steps, the all-reduce
priced as for 100 MB of gradients per stage in 4 MB buckets, ``inject.rank_links``). DeepSpeed's
default placement puts stage s on ranks 2s and 2s + 1, so every data-parallel group crosses the slow
link. (A single slow pair is no test of placement: 10 of the 28 pairs of this grid carry traffic,
and moving one pair onto a silent position removes it, which re-placement alone already does.)

Three runs, side by side in one launch, each on the placement ``pipemorph place`` chose for it from
the same link matrix (``plan.place.predict``):

- baseline: DeepSpeed's default placement, the static `zb` order;
- re-placement only (Falcon-style): the placement fastest for the static order, static `zb`;
- orchestrator: the placement fastest once its pipelines are planned, run with PipeMorph's control
  loop (`adaptive`, slow links delegated: `delegation: auto`);
- in-run: DeepSpeed's default placement at launch with ``"orchestrate": {"matrix": ...}``: the
  engine measures the slow all-reduce, re-maps its ranks to the orchestrator's placement while it
  trains (``engine.remap``), and the control loop then re-plans for the links now in the pipeline.

Iteration time: barrier before ``train_batch`` to barrier after it on rank 0, mean over the measured
iterations (after a warm-up long enough for the control loop to re-plan). Prints measured and
predicted times and the ratios Fig. 19 reports; writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/control/orchestrator.py [--iters 8] [--out out/orchestrator.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import exit_on_bad_input, print_table, relaunch, work_folder, write_json

STAGES, REPLICAS, MICROBATCHES, OP_MS, SLOW_MS = 4, 2, 12, 10.0, 30.0
WORLD = STAGES * REPLICAS
# The all-reduce priced and injected as for 100 MB of gradients per stage in 4 MB buckets: each of
# the 2(D - 1) ring steps sends a 50 MB part as 13 messages, each paying a slow ring link once.
GRAD_MB, CHUNK_MB = 100.0, 4.0
ALLREDUCE_MESSAGES = math.ceil(GRAD_MB / REPLICAS / CHUNK_MB)
MODES = ("baseline", "replacement", "orchestrator")
IN_RUN = "in-run"  # starts on DeepSpeed's default placement; the engine re-maps itself while training
IN_RUN_EXTRA = 4  # more unmeasured iterations for it: two to see the slow all-reduce, the re-mapping, a re-plan
PAPER = {"orchestrator_vs_replacement": 1.96, "orchestrator_vs_baseline": 3.6}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per run")
    ap.add_argument("--warmup", type=int, default=6, help="unmeasured iterations per run (the control loop re-plans)")
    ap.add_argument("--out", default="out/orchestrator.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the spec file of a torchrun worker
    return ap.parse_args()


def cross_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(WORLD) for b in range(a + 1, WORLD) if a % 2 != b % 2]


def plan_placements(work: Path) -> dict:
    """``pipemorph place`` on the matrix: the three placements, written as topology files, and the predictions."""
    from ds_pipemorph.fileio import dump, write_atomic
    from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.place.placement import TopologyFile
    from ds_pipemorph.plan.place.predict import Job, place

    matrix = LinkMatrix.model_validate({"world_size": WORLD, "pairs": [
        {"ranks": list(p), "latency_ms": SLOW_MS} for p in cross_pairs()]})
    job = Job(Costs.uniform(STAGES, OP_MS), MICROBATCHES, [GRAD_MB] * STAGES, chunk_mb=CHUNK_MB, direct=True)
    res = place(matrix, STAGES, REPLICAS, job)
    write_atomic(str(work / "links.json"), dump(matrix.model_dump(mode="json"), True))
    out = {}
    for mode in MODES:
        pred = getattr(res, mode)
        path = work / f"topology-{mode}.json"
        data = TopologyFile(dims=(STAGES, REPLICAS), ranks=pred.placement.as_lists()).model_dump(mode="json")
        write_atomic(str(path), dump(data, True))
        out[mode] = {"topology": str(path), "ranks": pred.placement.as_lists(), "predicted_ms": pred.iteration_ms,
                     "allreduce_ms": pred.allreduce_ms, "links_ms": pred.links_ms}
    out[IN_RUN] = dict(out["baseline"], matrix=str(work / "links.json"), predicted_ms=res.orchestrator.iteration_ms)
    return out


def section(mode: str, matrix: str = "") -> dict:
    inject = {"rank_links": {f"{a}-{b}": SLOW_MS for a, b in cross_pairs()}, "allreduce_messages": ALLREDUCE_MESSAGES}
    if mode == IN_RUN:
        return {"schedule": "adaptive", "delegation": {"mode": "auto"}, "nvtx": False, "inject": inject,
                "orchestrate": {"matrix": matrix, "grad_mb": GRAD_MB, "chunk_mb": CHUNK_MB}}
    if mode == "orchestrator":
        return {"schedule": "adaptive", "delegation": {"mode": "auto"}, "nvtx": False, "inject": inject}
    return {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}, "nvtx": False,
            "inject": inject}


def worker(spec_path: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.runtime.topology_file import load_topology
    from ds_pipemorph.inject.emulated import EmulatedStage

    spec = json.loads(Path(spec_path).read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
    results = {}
    for mode in (*MODES, IN_RUN):
        torch.manual_seed(0)
        model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, OP_MS, OP_MS, OP_MS) for _ in range(STAGES)],
                               topology=load_topology(spec["placements"][mode]["topology"]),
                               loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
               "train_batch_size": MICROBATCHES * REPLICAS, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
               "steps_per_print": 10**9, "pipemorph": section(mode, spec["placements"][mode].get("matrix", ""))}
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        warmup = spec["warmup"] + (IN_RUN_EXTRA if mode == IN_RUN else 0)
        seconds, all_seconds, remapped = [], [], []
        for k in range(warmup + spec["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(iter(data))
            dist.barrier()
            all_seconds.append(time.perf_counter() - t0)
            if k >= warmup:
                seconds.append(all_seconds[-1])
            if len(getattr(engine, "remaps", [])) > len(remapped):  # the handle re-mapped after this batch
                r = engine.remaps[-1]
                remapped.append({"after_iteration": k, "ok": r.ok, "ms": round(r.seconds * 1e3, 1),
                                 "bytes_sent": r.bytes_sent})
        replans = [vars(r)["iteration"] for r in engine.adapter.replans] if engine.adapter else []
        ranks = [[engine.module._topo.get_rank(pipe=s, data=d) for d in range(REPLICAS)] for s in range(STAGES)]
        engine.destroy()
        results[mode] = {"seconds": seconds, "all_seconds": all_seconds, "replans_after": replans,
                         "remapped": remapped, "ranks_at_end": ranks}
        dist.barrier()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    work = work_folder("pipemorph-orchestrator-")
    t = time.perf_counter()
    placements = plan_placements(work)
    place_s = time.perf_counter() - t
    spec = {"placements": placements, "iters": args.iters, "warmup": args.warmup, "result": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    code = relaunch(__file__, WORLD, "--worker", str(work / "spec.json"))
    if code != 0 or not Path(spec["result"]).exists():
        print(f"the 8-rank run failed (exit code {code})", file=sys.stderr)
        return 1
    measured = json.loads(Path(spec["result"]).read_text())
    ms = {m: 1e3 * statistics.mean(measured[m]["seconds"]) for m in (*MODES, IN_RUN)}
    rows = [[m, str(placements[m]["ranks"]), f"{ms[m]:.1f}", f"{placements[m]['predicted_ms']:.1f}", "-"] for m in MODES]
    moved = measured[IN_RUN]["remapped"]
    rows.append([f"{IN_RUN} (starts on the default)", str(measured[IN_RUN]["ranks_at_end"]), f"{ms[IN_RUN]:.1f}",
                 f"{placements[IN_RUN]['predicted_ms']:.1f}",
                 ", ".join(f"after iteration {m['after_iteration']} in {m['ms']:.0f} ms" for m in moved if m["ok"]) or "never"])
    print_table(f"{REPLICAS} replicas x {STAGES} stages, {MICROBATCHES} micro-batches, even and odd ranks joined by "
                f"a {SLOW_MS:.0f} ms link; mean of {args.iters} iterations after {args.warmup} "
                f"({args.warmup + IN_RUN_EXTRA} for {IN_RUN})",
                ["mode", "ranks[stage][replica]", "measured ms", "predicted ms", "re-mapped in the run"], rows)
    ratios = {"replacement_vs_baseline": ms["baseline"] / ms["replacement"],
              "orchestrator_vs_replacement": ms["replacement"] / ms["orchestrator"],
              "orchestrator_vs_baseline": ms["baseline"] / ms["orchestrator"],
              "in_run_vs_replacement": ms["replacement"] / ms[IN_RUN],
              "in_run_vs_baseline": ms["baseline"] / ms[IN_RUN]}
    print_table("speed-ups (Fig. 19 reports orchestrator over re-placement alone 1.96x, over doing nothing 3.6x)",
                ["ratio", "measured", "paper"],
                [[k, f"{v:.2f}x", f"{PAPER[k]:.2f}x" if k in PAPER else "-"] for k, v in ratios.items()])
    write_json(args.out, {"benchmark": "orchestrator", "stages": STAGES, "replicas": REPLICAS,
                          "microbatches": MICROBATCHES, "op_ms": OP_MS, "slow_ms": SLOW_MS, "place_s": place_s,
                          "placements": placements, "measured": measured, "measured_ms": ms, "ratios": ratios,
                          "orchestrator_beats_replacement": ms["orchestrator"] < ms["replacement"]})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
