"""PipeMorphEngine against torch pipelining and a plain torch.distributed loop, paired in one job.

4 stages, 12 micro-batches, emulated stages whose F, B and W each take 10 ms (sleeps around tiny
real math, ``ds_pipemorph.inject.emulated``), no link delay, one CPU rank per stage. One job builds
our engine with the ``zb`` plan and, one after the other, each runner it is compared with (each
trains the same math: SGD without gradient clipping, so our engine runs with DeepSpeed's
``gradient_clipping`` 0 instead of its default 1.0, whose norm is all-reduced over the pipeline at
every step):

- ``bare_zb``: the same plan run by a plain torch.distributed loop, without DeepSpeed or our engine
  (``_bare_runner.py``): this machine's floor for any runtime. It posts every receive of the
  iteration up front, and so does ours here (``recv_window`` = the micro-batch count): the two post
  alike and the ratio is the runtime's own cost;
- ``ours_window2``: our engine again with a ``recv_window`` of 2 (the default is 1), which bounds
  receive memory and posts each next receive between two ops (on this machine every call between ops pays a
  cold start: a ``torch.empty`` right after a 10 ms sleep takes 0.1 ms, not 1 us);
- ``torch_zbv``, ``torch_interleaved_zb``, ``torch_1f1b``: torch.distributed.pipelining's
  ``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble`` (two virtual stages per rank, each
  half the work) and ``Schedule1F1B`` on the same emulated stage (``_torch_runner.py``).

Against each, the two alternate every iteration in the cycle ``X ours X' ours`` (``X'`` is the
runner again; ``ds_pipemorph.paired``): every runner keeps its own model, all share one
process group and consume every message of an iteration within it. An iteration is timed from a
barrier before ``train_batch`` to the last rank's return. Per runner: ours / X, the median of the
per-pair ratios with its bootstrap 95 % interval, the X'/X noise check and the verdict ("no
difference measurable here" when the interval holds 1). Also: ours over the planner's prediction
(the median of our measured iterations over the replay), where our iteration goes per rank, and
B + W against one fused backward on a real transformer block (interleaved repetitions; with
glibc's default malloc, which returns large freed blocks to the OS so that tensors the split keeps
alive a little longer make later allocations fault fresh pages, and with one that keeps freed
memory, as GPU caching allocators do; and on a small block, where fixed per-call costs weigh
more). ``--anchors instruction,op`` adds the stricter ruler (an emulated op's 10 ms counted from
its math, not from its instruction). Prints tables and writes JSON.

Stock DeepSpeed is another engine class and cannot share a job with ours: ``pipemorph paired zb
stock-1f1b`` alternates whole short jobs of the two.

    DS_ACCELERATOR=cpu python benchmarks/engine/engine_zb_vs_1f1b.py [--pairs 12] [--warmup 4]
        [--runners bare_zb,ours_window2,torch_zbv,torch_interleaved_zb,torch_1f1b] [--anchors instruction]
        [--no-block] [--out out/engine_zb_vs_1f1b.json]

(re-launches itself with ``torchrun --standalone --nproc_per_node 4`` when not started by torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import CACHING_MALLOC, print_table, relaunch, write_json

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
TARGET_OVER_PREDICTED = 1.05
RUNNERS = ("bare_zb", "ours_window2", "torch_zbv", "torch_interleaved_zb", "torch_1f1b")
LABELS = {"bare_zb": "plain torch.distributed loop (zb)", "ours_window2": "ours with recv_window 2",
          "torch_zbv": "torch ScheduleZBVZeroBubble",
          "torch_interleaved_zb": "torch ScheduleInterleavedZeroBubble", "torch_1f1b": "torch Schedule1F1B"}
# Where an emulated op's 10 ms start (inject/emulated.py): "instruction" = when the runner began
# the instruction (its Python overlaps the op, as it overlaps launched kernels on a GPU; headline);
# "op" = when the emulated math starts (every microsecond of runtime work adds: the strict ruler).
ANCHORS = ("instruction", "op")
REPO = Path(__file__).resolve().parents[2]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12, help="ours/X pairs per runner (A/A pairs: half as many)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured alternating iterations per runner")
    ap.add_argument("--runners", default=",".join(RUNNERS), help="a comma-separated subset of " + ",".join(RUNNERS))
    ap.add_argument("--anchors", default="instruction", help="instruction, op or both (comma-separated)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    ap.add_argument("--no-block", action="store_true", help="skip B + W against fused on a transformer block")
    ap.add_argument("--out", default="out/engine_zb_vs_1f1b.json")
    ap.add_argument("--block", type=int, nargs=3, metavar=("D_MODEL", "SEQ", "REPS"),
                    help=argparse.SUPPRESS)  # internal: measure one transformer block and print JSON
    args = ap.parse_args()
    for name, given, allowed in (("--runners", args.runners, RUNNERS), ("--anchors", args.anchors, ANCHORS)):
        bad = [x for x in given.split(",") if x not in allowed]
        if bad:
            ap.error(f"{name}: '{bad[0]}' is not one of {', '.join(allowed)}")
    return args


def build(kind: str):
    """Our engine (``ours``, or ``ours_window2``) or the runner ``kind`` on this rank."""
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.inject.emulated import EmulatedStage

    if kind.startswith("torch_"):
        from _torch_runner import TorchRunner

        return TorchRunner(kind, dist.get_rank(), STAGES, 8, OP_MS, MICROBATCHES)
    if kind == "bare_zb":
        from _bare_runner import BareRunner

        return BareRunner(zb_plan(), dist.get_rank(), STAGES, 8, OP_MS)
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, OP_MS, OP_MS, OP_MS) for _ in range(STAGES)],
                           num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9, "gradient_clipping": 0.0,  # the runners compared with do not clip
           "pipemorph": {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}, "nvtx": False,
                         "recv_window": 2 if kind == "ours_window2" else MICROBATCHES}}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def zb_plan():
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    return build_plan(parse_config({"schedule": "zb"}), STAGES, MICROBATCHES)


def compute_spans(runner) -> list:
    """Where ``runner`` records [start, end] ns of its F, B, W: the runners keep their own list; our
    engine records into a new one through an engine hook, stock DeepSpeed's handlers are wrapped once."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    from ds_pipemorph.runtime.instructions import BackwardInputPass, BackwardWeightPass

    if hasattr(runner, "compute_spans"):
        return runner.compute_spans
    spans: list = []

    def timed(fn):
        def run(self, **kw):
            t0 = time.monotonic_ns()
            fn(self, **kw)
            spans.append((t0, time.monotonic_ns()))
        return run

    kinds = (ForwardPass, BackwardPass, BackwardInputPass, BackwardWeightPass)
    if hasattr(runner, "add_hooks"):  # our engine: an engine hook after each compute op (runtime.hooks)
        from ds_pipemorph.runtime.hooks import EngineHooks

        class Spans(EngineHooks):
            ops = frozenset(kinds)

            def after_op(self, engine, instruction, kwargs, started):
                end = time.monotonic_ns()
                spans.append((end - int((time.perf_counter() - started) * 1e9), end))

        runner.add_hooks(Spans())
        return spans
    runner._INSTRUCTION_MAP = {k: (timed(v) if k in kinds else v) for k, v in runner._INSTRUCTION_MAP.items()}
    return spans


def breakdown(records, t0: int, t1: int) -> dict:
    """Where one rank's iteration went, from the engine's op records (ms): inside compute
    instructions beyond the emulated ops' own time, inside sends, waiting in receives, in the
    other instructions (load, wait for sends, reductions, optimizer step), and between
    instructions (dispatch: the engine's and DeepSpeed's own Python around the instructions)."""
    out = {"compute_extra": 0.0, "send": 0.0, "recv_wait": 0.0, "other": 0.0}
    inside = 0
    for r in records:
        d = r.end_ns - r.start_ns
        inside += d
        name = r.op
        if name[:1] in "FBW" and name[1:].isdigit():
            out["compute_extra"] += d / 1e6 - OP_MS
        elif name.startswith("SEND_"):
            out["send"] += d / 1e6
        elif name.startswith("RECV_"):
            out["recv_wait"] += d / 1e6
        else:
            out["other"] += d / 1e6
    out["dispatch"] = (t1 - t0 - inside) / 1e6
    out["ops"] = len(records)
    return out


def timed_iteration(runner, spans: list, data, parts: list | None = None) -> tuple[float, float]:
    """One ``train_batch``: wall time (a barrier before it to the last rank's return) and
    docs/design.md's iteration time (first F/B/W start to last F/B/W end over all ranks), in ms.
    With ``parts``, this rank's ``breakdown`` of the iteration (our engine) is appended there."""
    import torch
    import torch.distributed as dist

    spans.clear()
    dist.barrier()
    t0 = time.monotonic_ns()
    runner.train_batch(iter(data))
    t1 = time.monotonic_ns()
    first, last = min(a for a, _ in spans), max(b for _, b in spans)
    both = torch.tensor([-t0, t1, -first, last], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # earliest starts, latest ends (one clock per machine)
    if parts is not None:
        parts.append(breakdown(runner.op_records, t0, t1))
    return (both[0].item() + both[1].item()) / 1e6, (both[2].item() + both[3].item()) / 1e6


def alternate(other, ours, warmup: int, pairs: int, parts: list | None) -> list[dict]:
    """``other`` (A) and ``ours`` (B), each a (runner, its compute spans), every iteration in the
    cycle ``X ours X' ours ...``; per iteration: side, wall ms, op-span ms (the same on every rank).
    Our engine's breakdown of each measured iteration goes into ``parts`` (if given)."""
    import torch

    from ds_pipemorph.paired import A_SIDE, cycles_for, sequence

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
    sides = sequence(warmup + 4 * cycles_for(pairs), warmup)
    rows = []
    for i, label in enumerate(sides):
        runner, spans = other if label in A_SIDE else ours
        keep = parts if (label == "B" and i >= warmup) else None
        wall, span = timed_iteration(runner, spans, data, keep)
        rows.append({"side": label, "ms": wall, "op_span_ms": span})
    return rows


def predicted_ms() -> float:
    """The replay simulator's iteration time of the ``zb`` plan at F = B = W = ``OP_MS``."""
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sim.simulate import replay

    return replay(zb_plan(), Costs.uniform(STAGES, OP_MS), MICROBATCHES).iteration_ms


def transformer_block_split_vs_fused(d_model: int, seq: int, reps: int = 12) -> dict:
    """B + W against one fused backward on a real transformer block (medians of interleaved reps),
    with the minor page faults each takes (memory the allocator had returned to the OS)."""
    import resource

    import torch

    from ds_pipemorph.runtime.bw_split import backward_input

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    torch.manual_seed(0)
    torch.set_num_threads(1)
    blk = torch.nn.TransformerEncoderLayer(d_model, d_model // 64, 4 * d_model, dropout=0.0, batch_first=True)
    params = list(blk.parameters())
    fused, b_t, w_t, f_pf, s_pf = [], [], [], [], []
    for _ in range(reps + 2):
        x = torch.randn(4, seq, d_model, requires_grad=True)
        y = blk(x)
        gy = torch.randn_like(y)
        pf, t = faults(), time.perf_counter()
        y.backward(gy)
        fused.append(time.perf_counter() - t)
        f_pf.append(faults() - pf)
        x = torch.randn(4, seq, d_model, requires_grad=True)
        y = blk(x)
        pf, t = faults(), time.perf_counter()
        _, work = backward_input([y], [gy], [x], params)
        t1 = time.perf_counter()
        del y
        work.run()
        b_t.append(t1 - t)
        w_t.append(time.perf_counter() - t1)
        s_pf.append(faults() - pf)
    med = lambda v: statistics.median(v[2:]) * 1e3  # noqa: E731
    split = [b + w for b, w in zip(b_t[2:], w_t[2:])]
    total = statistics.median(split) * 1e3
    # Medians are the headline; minimums are reported too because other load on a shared machine
    # only ever adds time, so min/min is the least disturbed estimate.
    return {"block": f"TransformerEncoderLayer(d={d_model}, {d_model // 64} heads, ff {4 * d_model}), "
                     f"batch 4 x seq {seq}, 1 thread",
            "reps": reps, "fused_ms": round(med(fused), 3), "b_ms": round(med(b_t), 3), "w_ms": round(med(w_t), 3),
            "b_plus_w_ms": round(total, 3), "ratio": round(total / med(fused), 4),
            "ratio_of_minimums": round(min(split) / min(fused[2:]), 4),
            "page_faults_fused": statistics.median(f_pf[2:]), "page_faults_split": statistics.median(s_pf[2:])}


def block_in_subprocess(d_model: int, seq: int, reps: int, caching_malloc: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(CACHING_MALLOC if caching_malloc else {})}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, __file__, "--block", str(d_model), str(seq), str(reps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["malloc"] = "caching (MALLOC_MMAP_THRESHOLD_=1G, TRIM 4G)" if caching_malloc else "glibc default"
    return res


def main() -> int:
    args = parse_args()
    if args.block:
        sys.path.insert(0, str(REPO))
        d_model, seq, reps = args.block
        print(json.dumps(transformer_block_split_vs_fused(d_model, seq, reps)))
        return 0
    if "LOCAL_RANK" not in os.environ:
        return relaunch(__file__, STAGES)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(REPO))
    import deepspeed
    import torch.distributed as dist

    from ds_pipemorph.inject.emulated import ANCHOR_ENV

    deepspeed.init_distributed(dist_backend="gloo")
    engine = build("ours")
    ours = (engine, compute_spans(engine))
    others: dict = {}
    runs: dict = {}  # (anchor, runner) -> iterations
    parts: list = []  # this rank's breakdown of our measured iterations (instruction ruler)
    for anchor in args.anchors.split(","):
        os.environ[ANCHOR_ENV] = anchor  # read by every emulated op
        for kind in args.runners.split(","):
            if kind not in others:
                runner = build(kind)
                others[kind] = (runner, compute_spans(runner))
            mine = parts if anchor == "instruction" else None
            runs[(anchor, kind)] = alternate(others[kind], ours, args.warmup, args.pairs, mine)
            dist.barrier()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, parts)
    for runner, _ in [ours, *others.values()]:
        if hasattr(runner, "destroy"):
            runner.destroy()
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        report(args, runs, every_rank)
    return 0


def report(args, runs: dict, every_rank: list) -> None:
    from ds_pipemorph.paired import compare

    predicted = predicted_ms()
    out = {"stages": STAGES, "microbatches": MICROBATCHES, "op_ms": OP_MS, "link_delay_ms": 0,
           "method": "one job; per runner X the cycle X ours X' ours, each ratio the median of per-pair "
                     "ratios ours/X with a 95 % percentile bootstrap interval",
           "pairs": args.pairs, "warmup": args.warmup, "seed": args.seed, "predicted_ms": predicted,
           "anchors": {}}
    for anchor in args.anchors.split(","):
        rows, section, verdicts = [], {}, []
        ours_ms, ours_span = [], []
        for kind in args.runners.split(","):
            it = runs[(anchor, kind)]
            sides = [r["side"] for r in it]
            c = compare(sides, [r["ms"] for r in it], args.warmup, seed=args.seed)
            span = compare(sides, [r["op_span_ms"] for r in it], args.warmup, seed=args.seed)
            measured = it[args.warmup:]
            ours_ms += [r["ms"] for r in measured if r["side"] == "B"]
            ours_span += [r["op_span_ms"] for r in measured if r["side"] == "B"]
            section[kind] = {"comparison": c.as_dict(), "op_span_comparison": span.as_dict(), "iterations": it}
            r, n = c.ratio, c.noise
            rows.append([f"ours / {kind}", f"{r.median:.3f}", f"[{r.lo:.3f}, {r.hi:.3f}]", r.pairs,
                         f"{n.median:.3f} [{n.lo:.3f}, {n.hi:.3f}] ({n.pairs})" if n else "-",
                         f"{c.b_median_ms:.1f} / {c.a_median_ms:.1f}", span.ratio.text()])
            verdicts.append(f"ours / {kind}: {c.verdict}")
        over = statistics.median(ours_ms) / predicted
        over_span = statistics.median(ours_span) / predicted
        section["ours_over_predicted"] = round(over, 4)
        section["ours_op_span_over_predicted"] = round(over_span, 4)
        out["anchors"][anchor] = section
        print_table(f"ours (PipeMorphEngine, zb plan) against X, alternated every iteration in one job: {STAGES} "
                    f"stages x {MICROBATCHES} micro-batches, F=B=W={OP_MS:g} ms emulated, ops anchored at the "
                    f"{anchor} start",
                    ["comparison", "median ratio", "95% interval", "pairs", "X'/X noise [95%] (pairs)",
                     "median ms ours / X", "op span ours / X [95%]"], rows)
        print("\n".join(verdicts))
        print(f"ours / predicted ({predicted:.1f} ms) = {over:.4f} (op span {over_span:.4f}; target <= "
              f"{TARGET_OVER_PREDICTED}): the median of all {len(ours_ms)} measured iterations of ours")
    keys = ("compute_extra", "send", "recv_wait", "other", "dispatch", "ops")
    if all(every_rank):
        per_rank = [{k: statistics.median(p[k] for p in rank_parts) for k in keys} for rank_parts in every_rank]
        out["ours_breakdown_ms"] = [{k: round(v, 3) for k, v in p.items()} for p in per_rank]
        print_table("ours, where each rank's iteration goes (ms per iteration, median; instruction ruler)",
                    ["rank", "in F/B/W beyond the op", "in sends", "waiting in receives", "other instructions",
                     "between instructions", "instructions"],
                    [[k, f"{p['compute_extra']:.2f}", f"{p['send']:.2f}", f"{p['recv_wait']:.2f}",
                      f"{p['other']:.2f}", f"{p['dispatch']:.2f}", f"{p['ops']:.0f}"] for k, p in enumerate(per_rank)])
    if not args.no_block:
        blocks = [block_in_subprocess(512, 128, 20, caching_malloc=False),
                  block_in_subprocess(512, 128, 20, caching_malloc=True),
                  block_in_subprocess(256, 64, 40, caching_malloc=False)]
        out["transformer_block_split"] = blocks
        for b in blocks:
            print(f"{b['block']}, {b['malloc']}: fused {b['fused_ms']:.2f} ms, B {b['b_ms']:.2f} + W {b['w_ms']:.2f} "
                  f"= {b['b_plus_w_ms']:.2f} ms, ratio {b['ratio']:.4f} (min/min {b['ratio_of_minimums']:.4f}; "
                  f"target <= 1.05); page faults per backward: fused {b['page_faults_fused']:g}, "
                  f"B + W {b['page_faults_split']:g}")
    write_json(args.out, out)


if __name__ == "__main__":
    sys.exit(main())
