"""Peak memory of one iteration on a device against the engine's prediction of its activations.

    torchrun --standalone --nproc_per_node 4 scripts/gpu_check/peak_memory.py OUT.json --device cpu
    torchrun --standalone --nproc_per_node 4 scripts/gpu_check/on_gpu0.py scripts/gpu_check/peak_memory.py \\
        OUT.json --device cuda:0

Every rank trains the jobs of ``JOBS`` one after another (4 stages x 8 micro-batches of an MLP whose
blocks save far more for the backward than they send: ``Block``): stock DeepSpeed 1F1B, and the engine
with ``zb``, ``adaptive`` and ``adaptive`` with ``memory.budget`` 1.5. The first iteration is the
engine's own measurement (``runtime.act_meter``: F's bytes per micro-batch, ``activation_bytes``); the
next ``MEASURED`` are measured here (``IterationPeak``), each from its start to its end:

- on a CUDA device (``--device cuda:0``), ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats`` at the iteration's start, less ``memory_allocated`` then (parameters,
  optimizer state, what the engine keeps between iterations): the iteration's transient peak;
- on CPU (``DS_ACCELERATOR=cpu``, ``--device cpu``), torch has no allocator statistics: the figure is
  the engine's own activation meter (``act_meter.SavedBytes``) around the iteration, the most bytes
  saved for the backward at once. On a GPU the meter runs too, beside the allocator's figure.

The prediction is the engine's: the plan's peak activation micro-batches per stage
(``plan.ir.memory.peak_units``, as the start-up line of ``plans.describe_memory`` logs it) times the
bytes one micro-batch keeps (``activation_bytes[stage].f``, as the first iteration's line logs it and
``profile_out``'s ``memory.activation_mb`` holds it); stock 1F1B's is ``S - s`` of them (``.stock``).
``compare`` then checks, per rank and iteration, (a) the engine with the default memory settings
holds no more than stock x ``STOCK_FACTOR``, (b) the measured peak lies in ``bounds``: at least the
micro-batches held between F and B at once times ``f``, at most the prediction plus what else the
figure counts (said in ``WHAT_ELSE``), and a grant holds no more than its budget times stock's (with
the same factor). Rank 0 writes OUT.json: one row per job, rank and measured iteration.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

S, N = 4, 8
MEASURED = 2  # iterations measured after the engine's own first one
# device kind -> (width, rows of a micro-batch, blocks per stage): one message is rows x width fp32
SIZES = {"cuda": (256, 2048, 4), "cpu": (16, 64, 2)}
JOBS = {  # name -> pipemorph section (None: stock DeepSpeed)
    "stock": None,
    "zb": {"schedule": "zb"},
    "adaptive": {"schedule": "adaptive"},
    "adaptive_1.5": {"schedule": "adaptive", "memory": {"budget": 1.5}},
}
STOCK_FACTOR = 1.10
OPTIMIZER_FACTOR = 4  # on a device: gradients and the optimizer step's temporaries, in parameter bytes
WHAT_ELSE = ("beside the prediction (peak micro-batches x F's bytes each) the bound counts one B's transient "
             "(F's bytes of one micro-batch) and the output gradients B keeps for each W still pending; on a "
             "CUDA device also each held micro-batch's output (kept for B, not a saved tensor), the posted "
             "receives and the sends in flight (recv_window + send_window messages of each kind), and "
             f"{OPTIMIZER_FACTOR}x the stage's parameter bytes (gradients, the optimizer step)")
MIB = 1024 * 1024


# -- measuring (each rank) -------------------------------------------------------------------------
class IterationPeak:
    """The transient peak of what ``with`` wraps, on ``device``: the allocator's on CUDA, the activation
    meter's elsewhere; ``saved`` is the meter's on every device."""

    def __init__(self, device, params):
        import torch

        from ds_pipemorph.runtime.act_meter import SavedBytes

        self.device = torch.device(device)
        self.meter = SavedBytes(params)
        self.start = self.peak = self.saved = 0

    def __enter__(self) -> "IterationPeak":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        self.meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self.meter.__exit__(*exc)
        self.saved = self.meter.peak
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.peak = self.meter.peak  # (the meter opened empty: nothing saved before the iteration)


def held_counts(row) -> tuple[int, int]:
    """(the most micro-batches held between F and B at once, the most waiting between B and W)."""
    from ds_pipemorph.plan.ir.ops import Kind

    h = w = most_h = most_w = 0
    for op in row:
        h += (op.kind == Kind.F) - (op.kind == Kind.B)
        w += (op.kind == Kind.B) - (op.kind == Kind.W)
        most_h, most_w = max(most_h, h), max(most_w, w)
    return most_h, most_w


def _block(width: int):
    import torch

    class Block(torch.nn.Module):
        """x + fc2(gelu(fc1(x))), 4x wide inside: saves 9 messages' bytes for the backward, sends one."""

        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    return Block


def run_job(name: str, device: str, sizes: tuple[int, int, int], work: Path) -> list[dict]:
    """One job on this rank: its rows (one per measured iteration)."""
    import gc

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.plan.ir.memory import peak_units
    from ds_pipemorph.runtime.plans import RECV_WINDOW

    width, rows, blocks = sizes
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(_block(width)) for _ in range(S * blocks)], num_stages=S,
                           loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": N, "train_batch_size": N,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    section = JOBS[name]
    if section is None:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        extra = {"profile_out": str(work / "profile.yaml")} if name == "adaptive" else {}
        cfg["pipemorph"] = {**section, "nvtx": False, **extra}
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def data():
        g = torch.Generator().manual_seed(1)
        for _ in range(N):
            yield torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)

    stage = engine.stage_id
    message = rows * width * 4
    param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    out = []
    for i in range(1 + MEASURED):
        gc.collect()
        dist.barrier()
        if i == 0:  # the engine's own measurement (its meter would nest inside ours)
            engine.train_batch(data())
            continue
        plan = getattr(engine, "plan", None)  # the plan this iteration runs (re-plans apply after one)
        with IterationPeak(device, engine.module.parameters()) as peak:
            engine.train_batch(data())
        row = {"job": name, "rank": dist.get_rank(), "stage": stage, "iteration": i, "measured": peak.peak,
               "saved": peak.saved, "start": peak.start, "device": str(torch.device(device)),
               "params": param_bytes, "in": message if stage > 0 else 0, "out": message if stage < S - 1 else 0}
        if plan is not None:
            units = peak_units(plan, min(engine.w_share, 1.0))[stage]
            most_h, most_w = held_counts(plan[stage])
            act = engine.activation_bytes[stage]
            cfg_ = engine.pipemorph
            row.update(units=units, held_f=most_h, held_w=most_w, f=act.f, w=act.w, grads=act.grads,
                       stock_units=S - stage, recv_window=cfg_.recv_window or RECV_WINDOW,
                       send_window=cfg_.send_window_in_force or 0)
        out.append(row)
    if section is not None:
        engine.destroy()  # rank 0 writes profile_out here
    del engine, model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_rank(out_path: Path, device: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    if dist.get_world_size() != S:
        raise SystemExit(f"peak_memory.py: run it on {S} ranks, not {dist.get_world_size()}")
    kind = torch.device(device).type
    rows: list[dict] = []
    work = out_path.parent
    for name in JOBS:
        rows += run_job(name, device, SIZES[kind], work)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        profile = work / "profile.yaml"
        result = {"device": kind, "sizes": dict(zip(("width", "rows", "blocks"), SIZES[kind])),
                  "rows": [r for got in every for r in got],
                  "profile_out": profile.read_text() if profile.is_file() else None}
        out_path.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# -- comparing (the driver; no torch) --------------------------------------------------------------
def bounds(row: dict, f: int, device: str) -> tuple[int, int, int]:
    """(lower, predicted, upper) bytes of an engine row's measured peak; ``f`` F's bytes per micro-batch."""
    predicted = row["units"] * f
    lower = row["held_f"] * f
    upper = predicted + f + row["held_w"] * row["grads"]
    if device == "cuda":
        messages = (row["recv_window"] + row["send_window"]) * (row["in"] + row["out"])
        upper += row["held_f"] * row["out"] + messages + OPTIMIZER_FACTOR * row["params"]
    return lower, predicted, upper


def judge(row: dict, stock: dict, f: int, device: str) -> tuple[dict, list[str]]:
    """(numbers, failures) of one job's row against stock's row of the same rank and iteration."""
    job, s, measured = row["job"], row["stage"], row["measured"]
    where = f"{job}: rank {row['rank']} (stage {s}) iteration {row['iteration']}"
    vs_stock = measured / stock["measured"] if stock["measured"] else float("inf")
    numbers = {"stage": s, "measured_mib": round(measured / MIB, 3), "saved_mib": round(row["saved"] / MIB, 3),
               "vs_stock": round(vs_stock, 3), "f_mib": round(f / MIB, 4)}
    if job == "stock":
        predicted = (S - s) * f
        return {**numbers, "predicted_mib": round(predicted / MIB, 3), "vs_predicted": round(measured / predicted, 3)}, []
    failures = []
    allowed = STOCK_FACTOR * (JOBS[job].get("memory", {}).get("budget", 1.0))
    if vs_stock > allowed:  # (a), and a grant within its budget
        failures.append(f"{where} held {measured / MIB:.2f} MiB, {vs_stock:.3f}x stock's {stock['measured'] / MIB:.2f} "
                        f"(allowed {allowed:.3f}x)")
    lower, predicted, upper = bounds(row, f, device)
    if not lower <= measured <= upper:  # (b)
        failures.append(f"{where} measured {measured / MIB:.3f} MiB outside [{lower / MIB:.3f}, {upper / MIB:.3f}] "
                        f"around the predicted {predicted / MIB:.3f} ({row['units']:g} micro-batches x {f / MIB:.3f} MiB)")
    return {**numbers, "predicted_mib": round(predicted / MIB, 3), "vs_predicted": round(measured / predicted, 3),
            "units": row["units"], "lower_mib": round(lower / MIB, 3), "upper_mib": round(upper / MIB, 3)}, failures


def compare(result: dict) -> tuple[dict, list[str]]:
    """(key numbers, failures) of a rank 0 result file: the checks of the module's docstring; per job
    and rank, the numbers of its iteration that held the most."""
    rows = result["rows"]
    by = {(r["job"], r["rank"], r["iteration"]): r for r in rows}
    f_of = {r["stage"]: r["f"] for r in rows if r["job"] == "zb"}  # the same model in every job
    keys: dict = {"device": result["device"], "sizes": result["sizes"], "what_else": WHAT_ELSE}
    failures: list[str] = []
    for job in JOBS:
        for rank in sorted({r["rank"] for r in rows}):
            most = -1
            for i in sorted({r["iteration"] for r in rows}):
                row, stock = by.get((job, rank, i)), by.get(("stock", rank, i))
                if row is None or stock is None:
                    failures.append(f"{job}: no measurement of rank {rank} in iteration {i}")
                    continue
                numbers, failed = judge(row, stock, f_of[row["stage"]], result["device"])
                failures += failed
                if row["measured"] > most:
                    most = row["measured"]
                    keys.setdefault(job, {})[f"rank{rank}"] = numbers
    profile = result.get("profile_out")
    if profile is None:
        failures.append("adaptive: profile_out was not written")
    else:
        import yaml

        mb = (yaml.safe_load(profile).get("memory") or {}).get("activation_mb")
        want = [round(f_of[s] / MIB, 6) for s in range(S)]
        if mb is None or [round(x, 6) for x in mb] != want:
            failures.append(f"adaptive: profile_out's memory.activation_mb {mb} is not F's bytes {want} MiB")
        keys["profile_out_activation_mb"] = mb
    return keys, failures


def table(result: dict) -> str:
    """One line per job, rank and iteration: what was measured and predicted, MiB."""
    lines = [f"{'job':<13}{'rank':>5}{'stage':>6}{'iter':>5}{'measured':>10}{'saved':>9}{'predicted':>10}{'units':>6}"
             f"   (MiB; {result['device']})"]
    f_of = {r["stage"]: r["f"] for r in result["rows"] if r["job"] == "zb"}
    for r in sorted(result["rows"], key=lambda r: (list(JOBS).index(r["job"]), r["rank"], r["iteration"])):
        units = r.get("units", S - r["stage"])
        lines.append(f"{r['job']:<13}{r['rank']:>5}{r['stage']:>6}{r['iteration']:>5}{r['measured'] / MIB:>10.3f}"
                     f"{r['saved'] / MIB:>9.3f}{units * f_of[r['stage']] / MIB:>10.3f}{units:>6g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", required=True, help="cpu, or a CUDA device (cuda:0)")
    a = ap.parse_args(argv)
    if os.environ.get("LOCAL_RANK") is None:
        ap.error("run it under torchrun (one rank per stage)")
    run_rank(a.out, a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
