"""Stock DeepSpeed 1F1B against PipeMorphEngine running the `zb` plan, side by side in one run.

4 stages, 12 micro-batches, emulated stages whose F, B and W each take 10 ms (sleeps around tiny
real math, ``ds_pipemorph.testing.emulated``), no link delay. Iteration time is measured the same
way for both engines: from the barrier before ``train_batch`` to the last rank's return (headline),
and as docs/design.md's iteration time (first op start to last op end, over all ranks); medians over
several iterations after warm-up. The same plan run by a plain torch.distributed loop, without
DeepSpeed or our engine (``_bare_runner.py``), is measured in the same run: this machine's floor
for any runtime, printed next to the engines. Also measures, on a real transformer block (with
glibc's default malloc, which returns large freed blocks to the OS so that tensors the split keeps
alive a little longer make later allocations fault fresh pages, and with one that keeps freed
memory, as GPU caching allocators do; and on a small block, where fixed per-call costs weigh
more), B + W time against one fused backward, with the page faults of each. Prints a table and
writes JSON.

    DS_ACCELERATOR=cpu python benchmarks/engine_zb_vs_1f1b.py [--iters 8] [--out out/engine_zb_vs_1f1b.json]

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

from _util import CACHING_MALLOC, relaunch, write_json

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0
TARGET_OVER_PREDICTED = 1.05
# adaptive: extra row, Alg. 1 warm-up; bare_zb: the zb plan run by plain torch.distributed, no
# DeepSpeed and no engine (_bare_runner.py): this machine's floor for any runtime
# torch_*: torch.distributed.pipelining's Schedule1F1B, ScheduleInterleavedZeroBubble and
# ScheduleZBVZeroBubble (two virtual stages per rank, each half the work) on the same emulated stage
# (_torch_runner.py)
ENGINES = ("stock_1f1b", "pipemorph_zb", "pipemorph_adaptive", "bare_zb", "torch_1f1b", "torch_interleaved_zb",
           "torch_zbv")
# Where an emulated op's 10 ms start (testing/emulated.py): "instruction" = when the engine began
# the instruction (its Python overlaps the op, as it overlaps launched kernels on a GPU; headline);
# "op" = when the emulated math starts (every microsecond of engine work adds: the strict ruler).
ANCHORS = ("instruction", "op")
REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per engine")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per engine")
    ap.add_argument("--out", default="out/engine_zb_vs_1f1b.json")
    ap.add_argument("--block", type=int, nargs=3, metavar=("D_MODEL", "SEQ", "REPS"),
                    help=argparse.SUPPRESS)  # internal: measure one transformer block and print JSON
    return ap.parse_args()


def build(kind: str):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.testing.emulated import EmulatedStage

    if kind.startswith("torch_"):
        import torch.distributed as dist
        from _torch_runner import TorchRunner

        return TorchRunner(kind, dist.get_rank(), STAGES, 8, OP_MS, MICROBATCHES)
    if kind == "bare_zb":
        import torch.distributed as dist
        from _bare_runner import BareRunner

        from ds_pipemorph.runtime.config import parse_config
        from ds_pipemorph.runtime.plans import build_plan

        plan = build_plan(parse_config({"schedule": "zb"}), STAGES, MICROBATCHES)
        return BareRunner(plan, dist.get_rank(), STAGES, 8, OP_MS)
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(EmulatedStage, 8, OP_MS, OP_MS, OP_MS) for _ in range(STAGES)],
                           num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICROBATCHES,
           "train_batch_size": MICROBATCHES, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9}
    if kind == "stock_1f1b":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        schedule = kind.split("_", 1)[1]
        cfg["pipemorph"] = {"schedule": schedule, "delegation": {"mode": "off"}, "adapt": {"enabled": False}}
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def time_compute_ops(engine) -> list:
    """Wrap the engine's compute handlers (F, B, W, fused backward) to record [start, end] ns; stock
    DeepSpeed's also publish their start, as PipeMorphEngine's recorder does (``oprecords``), so
    that the emulated ops anchor their time the same way in both engines."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    from ds_pipemorph.runtime.instructions import BackwardInputPass, BackwardWeightPass
    from ds_pipemorph.testing.emulated import anchor_stock_engine

    spans: list = []

    def timed(fn):
        def run(self, **kw):
            t0 = time.monotonic_ns()
            fn(self, **kw)
            spans.append((t0, time.monotonic_ns()))
        return run

    if hasattr(engine, "compute_spans"):  # the bare runner times its ops itself
        return engine.compute_spans
    kinds = (ForwardPass, BackwardPass, BackwardInputPass, BackwardWeightPass)
    if not hasattr(engine, "recorder"):  # stock DeepSpeed: publish instruction starts as ours does
        anchor_stock_engine(engine)
    engine._INSTRUCTION_MAP = {k: (timed(v) if k in kinds else v) for k, v in engine._INSTRUCTION_MAP.items()}
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


def measure(engine, warmup: int, iters: int, parts: list | None = None) -> tuple[list[float], list[float]]:
    """Per iteration: wall time (barrier to the last rank's return from train_batch) and docs/design.md's
    iteration time (first op start to last op end over all ranks; ops are F, B, W). With ``parts``,
    this rank's ``breakdown`` of every measured iteration is appended there."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(MICROBATCHES)]
    spans = time_compute_ops(engine)
    wall, ops = [], []
    for i in range(warmup + iters):
        spans.clear()
        dist.barrier()
        t0 = time.monotonic_ns()
        engine.train_batch(iter(data))
        t1 = time.monotonic_ns()
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        both = torch.tensor([-t0, t1, -first, last], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # earliest starts, latest ends (one clock per machine)
        if i >= warmup:
            if parts is not None:
                parts.append(breakdown(engine.op_records, t0, t1))
            wall.append((both[0].item() + both[1].item()) / 1e6)
            ops.append((both[2].item() + both[3].item()) / 1e6)
    return wall, ops


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

    from ds_pipemorph.plan.baselines import deepspeed_1f1b
    from ds_pipemorph.plan.profile import Costs
    from ds_pipemorph.plan.simulate import replay
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    costs = Costs.uniform(STAGES, OP_MS)
    predicted = {
        "stock_1f1b": replay(deepspeed_1f1b(STAGES, MICROBATCHES), costs, MICROBATCHES, fused_backward=True).iteration_ms,
        "pipemorph_zb": replay(build_plan(parse_config({"schedule": "zb"}), STAGES, MICROBATCHES), costs,
                               MICROBATCHES).iteration_ms,
        "pipemorph_adaptive": replay(build_plan(parse_config({"schedule": "adaptive"}), STAGES, MICROBATCHES),
                                     costs, MICROBATCHES).iteration_ms,
    }
    predicted["bare_zb"] = predicted["pipemorph_zb"]
    # torch's 1F1B runs DeepSpeed's order with a fused backward; its zero-bubble schedules have no
    # prediction here (virtual stages), only their measured time.
    predicted.update(torch_1f1b=predicted["stock_1f1b"], torch_interleaved_zb=None, torch_zbv=None)
    from ds_pipemorph.testing.emulated import ANCHOR_ENV

    results = {a: {} for a in ANCHORS}
    op_spans = {a: {} for a in ANCHORS}
    parts: list = []  # pipemorph_zb, headline ruler: this rank's breakdown per measured iteration
    for kind in ENGINES:
        engine = build(kind)
        for anchor in ANCHORS:  # the same engine under both rulers, one after the other
            os.environ[ANCHOR_ENV] = anchor  # read by every emulated op
            mine = parts if (kind, anchor) == ("pipemorph_zb", "instruction") else None
            results[anchor][kind], op_spans[anchor][kind] = measure(engine, args.warmup, args.iters, mine)
            dist.barrier()
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, parts)
    dist.destroy_process_group()
    if rank != 0:
        return 0
    block = block_in_subprocess(512, 128, 20, caching_malloc=False)
    block_cached = block_in_subprocess(512, 128, 20, caching_malloc=True)
    small = block_in_subprocess(256, 64, 40, caching_malloc=False)
    report = {"stages": STAGES, "microbatches": MICROBATCHES, "op_ms": OP_MS, "link_delay_ms": 0,
              "iterations_measured": args.iters, "anchors": {}}
    for anchor in ANCHORS:
        med = {k: statistics.median(v) for k, v in results[anchor].items()}
        med_ops = {k: statistics.median(v) for k, v in op_spans[anchor].items()}
        ratio = lambda a, b: None if b is None else round(a / b, 4)  # noqa: E731
        report["anchors"][anchor] = {
            "engines": {k: {"predicted_ms": predicted[k], "median_ms": round(med[k], 3),
                            "over_predicted": ratio(med[k], predicted[k]),
                            "iterations_ms": [round(x, 3) for x in results[anchor][k]],
                            "op_span_median_ms": round(med_ops[k], 3),
                            "op_span_over_predicted": ratio(med_ops[k], predicted[k]),
                            "op_spans_ms": [round(x, 3) for x in op_spans[anchor][k]]} for k in med},
            "op_span_stock_over_ours": round(med_ops["stock_1f1b"] / med_ops["pipemorph_zb"], 4),
            "ours_over_predicted": round(med["pipemorph_zb"] / predicted["pipemorph_zb"], 4),
            "ours_op_span_over_predicted": round(med_ops["pipemorph_zb"] / predicted["pipemorph_zb"], 4),
            "stock_over_ours": round(med["stock_1f1b"] / med["pipemorph_zb"], 4),
            "bare_over_predicted": round(med["bare_zb"] / predicted["bare_zb"], 4),
            "ours_over_bare": round(med["pipemorph_zb"] / med["bare_zb"], 4),
            "ours_over_torch_zbv": round(med["pipemorph_zb"] / med["torch_zbv"], 4),
            "ours_over_torch_interleaved_zb": round(med["pipemorph_zb"] / med["torch_interleaved_zb"], 4),
            "ours_over_torch_1f1b": round(med["pipemorph_zb"] / med["torch_1f1b"], 4),
        }
        print(f"\nemulated ops anchored at the {anchor} start")
        print(f"{'engine':<22}{'predicted ms':>14}{'median ms':>12}{'min ms':>10}{'max ms':>10}{'op span ms':>12}")
        for k, v in results[anchor].items():
            pred = "-" if predicted[k] is None else f"{predicted[k]:.1f}"
            print(f"{k:<22}{pred:>14}{med[k]:>12.1f}{min(v):>10.1f}{max(v):>10.1f}{med_ops[k]:>12.1f}")
        r = report["anchors"][anchor]
        print(f"ours / predicted = {r['ours_over_predicted']:.4f} (op span {r['ours_op_span_over_predicted']:.4f}; "
              f"target <= {TARGET_OVER_PREDICTED});  stock / ours = {r['stock_over_ours']:.4f} (target >= 1.10)")
        print(f"ours / torch ZBV = {r['ours_over_torch_zbv']:.4f} (target < 1); ours / torch interleaved ZB = "
              f"{r['ours_over_torch_interleaved_zb']:.4f}; ours / torch 1F1B = {r['ours_over_torch_1f1b']:.4f}")
        print(f"this machine's floor: the zb plan without DeepSpeed or engine / predicted = "
              f"{r['bare_over_predicted']:.4f}; ours / that floor = {r['ours_over_bare']:.4f}")
    keys = ("compute_extra", "send", "recv_wait", "other", "dispatch", "ops")
    per_rank = [{k: statistics.median(p[k] for p in rank_parts) for k in keys} for rank_parts in every_rank]
    report["pipemorph_zb_breakdown_ms"] = [{k: round(v, 3) for k, v in p.items()} for p in per_rank]
    print("\npipemorph_zb, where each rank's iteration goes (ms per iteration, median; instruction ruler):")
    print(f"{'rank':<6}{'in F/B/W beyond the op':>24}{'in sends':>10}{'waiting in receives':>21}"
          f"{'other instructions':>20}{'between instructions':>22}{'instructions':>14}")
    for rank, p in enumerate(per_rank):
        print(f"{rank:<6}{p['compute_extra']:>24.2f}{p['send']:>10.2f}{p['recv_wait']:>21.2f}{p['other']:>20.2f}"
              f"{p['dispatch']:>22.2f}{p['ops']:>14.0f}")
    print("(median/min/max: barrier to the last rank's return from train_batch; op span: docs/design.md's "
          "iteration time, first F/B/W start to last F/B/W end over all ranks)")
    head = report["anchors"]["instruction"]
    report.update({
        "ours_over_predicted": head["ours_over_predicted"], "stock_over_ours": head["stock_over_ours"],
        "transformer_block_split": block,
        "transformer_block_split_caching_malloc": block_cached,
        "small_transformer_block_split": small,
        "targets": {"ours_over_predicted_max": TARGET_OVER_PREDICTED, "ours_over_torch_zbv_max": 1.0,
                    "stock_over_ours_min": 1.10, "split_over_fused_max": 1.05},
    })
    report["targets_met"] = {
        "ours_over_predicted": head["ours_over_predicted"] <= TARGET_OVER_PREDICTED,
        "ours_over_predicted_strict": report["anchors"]["op"]["ours_over_predicted"] <= TARGET_OVER_PREDICTED,
        "faster_than_torch_zbv": head["ours_over_torch_zbv"] < 1.0,
        "stock_over_ours": head["stock_over_ours"] >= 1.10,
        "split_over_fused": block["ratio"] <= 1.05,
    }
    for b in (block, block_cached, small):
        print(f"{b['block']}, {b['malloc']}: fused {b['fused_ms']:.2f} ms, B {b['b_ms']:.2f} + W {b['w_ms']:.2f} "
              f"= {b['b_plus_w_ms']:.2f} ms, ratio {b['ratio']:.4f} (min/min {b['ratio_of_minimums']:.4f}; "
              f"target <= 1.05); page faults per backward: fused {b['page_faults_fused']:g}, "
              f"B + W {b['page_faults_split']:g}")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
