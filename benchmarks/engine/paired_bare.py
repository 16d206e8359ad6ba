"""The engine against this machine's floor, paired: the same plan in ``PipeMorphEngine`` (A) and in a
plain torch.distributed loop (B, ``_bare_runner.BareRunner``), alternated every iteration in one job.

Both run the ``zb`` plan of the same emulated pipeline (F = B = W = ``--op-ms`` around tiny real
math, one CPU rank per stage) on the same process group: the engine through its transport, the
bare loop with its own tags, every message of an iteration consumed within it. Iterations follow
``A B A' B ...`` (``ds_pipemorph.paired``); each is timed from a barrier before the step to the
last rank's return. B/A below 1 is the share of the engine's iteration that the floor does not
pay. Prints the paired table with the A/A noise check and writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/engine/paired_bare.py [--stages 4] [--microbatches 12] [--op-ms 10]
        [--pairs 20] [--warmup 4] [--out out/paired_bare.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node STAGES`` when not started by torchrun).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import exit_on_bad_input, print_table, relaunch, work_folder, write_json


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=12)
    ap.add_argument("--op-ms", type=float, default=10.0)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default="out/paired_bare.json")
    return ap.parse_args()


def ranks(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from _bare_runner import BareRunner
    from ds_pipemorph.paired import A_SIDE, compare, cycles_for, sequence
    from ds_pipemorph.bench.paired_spec import PairedSpec, parse_side
    from ds_pipemorph.bench.paired_worker import build_engine, timed_step

    deepspeed.init_distributed(dist_backend="gloo")
    work = str(work_folder("pipemorph-paired-bare-"))
    spec = PairedSpec(a=parse_side("zb", "A"), b=parse_side("zb", "B"), stages=args.stages,
                      microbatches=args.microbatches, op_ms=args.op_ms, links_ms=[0.0] * (args.stages - 1),
                      cycles=cycles_for(args.pairs), warmup=args.warmup, out=os.path.join(work, "unused.json"),
                      progress_file=os.path.join(work, "progress"))
    engine = build_engine(spec)
    bare = BareRunner(engine.plan, engine.stage_id, args.stages, 8, args.op_ms)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(args.microbatches)]
    sides = sequence(spec.iterations, spec.warmup)
    times = []
    for label in sides:
        if label in A_SIDE:
            times.append(timed_step(lambda: engine.train_batch(iter(data))))
        else:
            times.append(timed_step(lambda: bare.train_batch(data)))
    engine.destroy()
    if dist.get_rank() == 0:
        c = compare(sides, times, spec.warmup)
        r, n = c.ratio, c.noise
        print_table(f"bare loop (B) / PipeMorphEngine (A), zb plan: {args.stages} stages x {args.microbatches} "
                    f"micro-batches, F=B=W={args.op_ms:g} ms, one job",
                    ["comparison", "median ratio", "95% interval", "pairs", "median ms"],
                    [["B/A bare / engine", f"{r.median:.3f}", f"[{r.lo:.3f}, {r.hi:.3f}]", r.pairs,
                      f"{c.b_median_ms:.1f} / {c.a_median_ms:.1f}"],
                     ["A'/A engine / itself", f"{n.median:.3f}", f"[{n.lo:.3f}, {n.hi:.3f}]", n.pairs, ""]])
        print(f"verdict: {c.verdict}")
        write_json(args.out, {"stages": args.stages, "microbatches": args.microbatches, "op_ms": args.op_ms,
                              "iterations": [{"side": s, "ms": t} for s, t in zip(sides, times)],
                              "warmup": spec.warmup, "comparison": c.as_dict()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = _args()
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, args.stages)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ranks(args)
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
