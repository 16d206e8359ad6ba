"""The split backward on real layers: B + W against one fused backward, per layer type, with the
weight-gradient store and with the generic graph split; and the activation bytes a stage holds.

    python benchmarks/engine/split_backward.py [--dims 128 256 512 1024] [--pairs 15] [--blocks 1]
                                        [--allocators glibc,caching] [--out FILE]

One process per allocator, one intra-op thread. Per dtype (fp32, bf16), model width d (4 heads,
FFN 4d; tokens: 4 x 64 at d = 128, 8 x 128 at d = 256, 4 x 128 above) and layer type (``Linear``
d -> 4d, ``LayerNorm`` d, ``block``: ``--blocks`` GPT blocks of ``recipes/gpt``, and ``encoder``:
one ``torch.nn.TransformerEncoderLayer`` of the same width and heads, no dropout):

- **B + W / fused**: each round runs one micro-batch's forward and fused backward on the stock
  layer (``torch.autograd.backward``), another through B (``bw_split.backward_input``) + W with
  the weight-gradient store (``runtime.wgrad_store``, the engine's path), and another through B + W
  of the generic graph split alone (``store=False``), in an order that rotates by round; the row is
  the median of the per-round ratios with its 95 % bootstrap interval (``ds_pipemorph.paired``).
  The forward is the stock module's in every way and is not timed.
- **allocators**: ``glibc`` is this machine's default malloc, which returns large freed blocks to
  the system, so a backward that keeps tensors longer (what B keeps for W) faults fresh pages in;
  ``caching`` keeps freed memory as a GPU's caching allocator does (``_util.CACHING_MALLOC``).
  Each row also gives the median minor page faults one backward took in each way (a fault is the
  first touch of a page the process got from the system).
- **activation bytes per micro-batch** (glibc run), measured with the engine's meter
  (``act_meter.SavedBytes``: distinct storages autograd saves, and what the store keeps; the stage
  input and parameters not counted): after F (what F leaves for B), after B (what B leaves for W),
  for the generic split, the store, ours checkpointed (``runtime.recompute``) and DeepSpeed's
  reentrant checkpoint (fused backward; it keeps each chunk's input on its ctx, out of the meter's
  sight: counted as the chunks' input sizes).
- **peak per stage**, computed from those bytes for a 4-stage job of 8 micro-batches: at each point
  of the stage's ZB-H1 op order, (micro-batches between F and B) x after-F bytes + (between B and W)
  x after-B bytes; stock 1F1B holds S - s micro-batches of after-F bytes.

Prints the tables and writes JSON (default ``split_backward.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "_common"))  # the shared helpers
sys.path.insert(0, str(HERE.parents[1] / "recipes" / "gpt"))

import torch  # noqa: E402

from _util import CACHING_MALLOC, check_out, exit_on_bad_input, print_table, write_json  # noqa: E402
from ds_pipemorph.paired import Interval, bootstrap_median  # noqa: E402
from ds_pipemorph.fileio import BadInput  # noqa: E402
from ds_pipemorph.plan.ir.profile import Costs  # noqa: E402
from ds_pipemorph.plan.sched.baselines import zb_h1  # noqa: E402
from ds_pipemorph.runtime.act_meter import SavedBytes  # noqa: E402
from ds_pipemorph.runtime.bw_split import backward_input  # noqa: E402
from ds_pipemorph.runtime.recompute import Recompute, split_checkpoint  # noqa: E402
from model import Block  # noqa: E402

HEADS = 4
STAGES, MICRO_BATCHES = 4, 8
ALLOCATORS = {"glibc": {}, "caching": CACHING_MALLOC}
LAYERS = ("Linear", "LayerNorm", "block", "encoder")


def tokens(d: int) -> tuple[int, int]:
    """(batch, sequence) for width ``d``."""
    return {128: (4, 64), 256: (8, 128)}.get(d, (4, 128))


class Stage(torch.nn.Module):
    """``blocks`` GPT blocks; ``ckpt``: None, "ours" (``split_checkpoint``) or "stock" (DeepSpeed's)."""

    def __init__(self, d: int, blocks: int, dtype, ckpt=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, HEADS) for _ in range(blocks)).to(dtype)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            if self.ckpt == "ours":
                x = split_checkpoint(b, x)
            elif self.ckpt == "stock":
                from deepspeed.runtime.activation_checkpointing import checkpointing

                x = checkpointing.checkpoint(b, x)
            else:
                x = b(x)
        return x


def layer(kind: str, d: int, blocks: int, dtype) -> torch.nn.Module:
    if kind == "Linear":
        return torch.nn.Linear(d, 4 * d).to(dtype)
    if kind == "LayerNorm":
        return torch.nn.LayerNorm(d).to(dtype)
    if kind == "encoder":
        return torch.nn.TransformerEncoderLayer(d, HEADS, 4 * d, dropout=0.0, batch_first=True).to(dtype)
    return Stage(d, blocks, dtype)


def _input(d, dtype):
    return torch.randn(*tokens(d), d, dtype=dtype, requires_grad=True)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_round(mod, d, dtype, order) -> tuple[dict, dict]:
    """Forward + backward of one micro-batch in each way, in ``order``: milliseconds of the
    backward, and the minor page faults it took."""
    out, faults = {}, {}
    params = list(mod.parameters())
    for way in order:
        x = _input(d, dtype)
        y = mod(x)
        g = torch.randn_like(y)
        f0 = _minor_faults()
        t0 = time.perf_counter()
        if way == "fused":
            torch.autograd.backward(y, g)
        else:
            with Recompute(params) as chunks:
                _, work = backward_input([y], [g], [x], params, store=way == "store")
            del y
            for w in [work, *chunks.works]:
                w.run()
        out[way] = (time.perf_counter() - t0) * 1e3
        faults[way] = _minor_faults() - f0
    return out, faults


def speed(kind: str, d: int, blocks: int, dtype, pairs: int) -> dict:
    torch.manual_seed(0)
    mod = layer(kind, d, blocks, dtype)
    ways = ["fused", "store", "graph"]
    for i in range(2):  # warm-up
        one_round(mod, d, dtype, ways)
    rounds, faults = zip(*(one_round(mod, d, dtype, ways[i % 3:] + ways[:i % 3]) for i in range(pairs)))
    res = {"fused_ms": [round(r["fused"], 3) for r in rounds], "fused_faults": [f["fused"] for f in faults]}
    for way in ("store", "graph"):
        ci = bootstrap_median([r[way] / r["fused"] for r in rounds])
        res[way] = {"ms": [round(r[way], 3) for r in rounds], "over_fused": dataclasses.asdict(ci),
                    "faults": [f[way] for f in faults]}
    return res


def bytes_held(stage, d, dtype, store: bool) -> tuple[int, int]:
    """(after F, after B) bytes for one micro-batch; the stage input and parameters not counted."""
    params = list(stage.parameters())
    x = _input(d, dtype)
    with SavedBytes([*params, x]) as meter:
        out = stage(x)
        after_f = meter.live
        if stage.ckpt == "stock":  # fused backward: nothing is left between B and W
            # DeepSpeed's checkpoint keeps each chunk's input on its ctx, out of the meter's sight:
            # the same tensors as ours keeps, counted here from the chunks' inputs.
            return (len(stage.blocks) - 1) * x.numel() * x.element_size(), 0  # the first one is the stage input
        with Recompute(params) as chunks:
            _, work = backward_input([out], [torch.ones_like(out)], [x], params, store=store)
        works = [work, *chunks.works]
        del out
        after_b = meter.live + sum(g.numel() * g.element_size() for w in works for g in w.kept_grads())
        for w in works:
            w.run()
    return after_f, after_b


def peak_bytes(stage_ops, after_f: int, after_b: int) -> int:
    """Peak of (F..B pending) x after_f + (B..W pending) x after_b over one stage's op order."""
    fb = bw = peak = 0
    for op in stage_ops:
        kind = str(op)[0]
        if kind == "F":
            fb += 1
        elif kind == "B":
            fb, bw = fb - 1, bw + 1
        elif kind == "W":
            bw -= 1
        peak = max(peak, fb * after_f + bw * after_b)
    return peak


def measure(args) -> dict:
    """Everything one allocator's process measures."""
    torch.set_num_threads(1)
    plan = zb_h1(Costs.uniform(STAGES), MICRO_BATCHES)
    speeds, memory = [], []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        for d in args.dims:
            for kind in args.layers:
                speeds.append({"dtype": name, "d_model": d, "layer": kind,
                               **speed(kind, d, args.blocks, dtype, args.pairs)})
            if not args.memory:
                continue
            torch.manual_seed(0)
            stage = Stage(d, args.blocks, dtype)
            mem = {"graph": bytes_held(stage, d, dtype, False), "store": bytes_held(stage, d, dtype, True)}
            for ckpt in ("ours", "stock"):
                st = Stage(d, args.blocks, dtype, ckpt)
                st.load_state_dict(stage.state_dict())
                mem[f"{ckpt} ckpt"] = bytes_held(st, d, dtype, ckpt == "ours")
            peaks = {s: {"stock 1F1B": (STAGES - s) * mem["graph"][0],
                         "zb graph": peak_bytes(plan[s], *mem["graph"]),
                         "zb store": peak_bytes(plan[s], *mem["store"]),
                         "stock 1F1B ckpt": (STAGES - s) * mem["stock ckpt"][0],
                         "zb ckpt": peak_bytes(plan[s], *mem["ours ckpt"])} for s in range(STAGES)}
            memory.append({"dtype": name, "d_model": d, "blocks": args.blocks,
                           "bytes_per_micro_batch": {k: {"after_F": v[0], "after_B": v[1]} for k, v in mem.items()},
                           "peak_bytes_per_stage": peaks})
    return {"speed": speeds, "memory": memory}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--pairs", type=int, default=15, help="rounds per row (each runs all three ways)")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    ap.add_argument("--allocators", default="glibc,caching", help=f"comma-separated, of {', '.join(ALLOCATORS)}")
    ap.add_argument("--out", default="split_backward.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: measure under this allocator into --out
    args = ap.parse_args()
    args.layers = args.layers.split(",")
    for name, given, known in (("--layers", args.layers, LAYERS), ("--allocators", args.allocators.split(","),
                                                                    ALLOCATORS)):
        bad = [g for g in given if g not in known]
        if bad:
            raise BadInput(f"{name}: unknown '{bad[0]}'; use a comma-separated list of {', '.join(known)}")
    if args.child:
        args.memory = args.child == args.allocators.split(",")[0]
        Path(args.out).write_text(json.dumps(measure(args)))
        return 0
    check_out(args.out)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for alloc in args.allocators.split(","):
            part = Path(tmp) / f"{alloc}.json"
            env = {k: v for k, v in os.environ.items() if k not in CACHING_MALLOC}
            cmd = [sys.executable, __file__, "--child", alloc, "--out", str(part), "--pairs", str(args.pairs),
                   "--blocks", str(args.blocks), "--layers", ",".join(args.layers), "--allocators", args.allocators,
                   "--dims", *map(str, args.dims)]
            code = subprocess.call(cmd, env={**env, **ALLOCATORS[alloc], "OMP_NUM_THREADS": "1"})
            if code:
                return code
            runs[alloc] = json.loads(part.read_text())
    speed_rows = []
    for alloc, run in runs.items():
        for r in run["speed"]:
            fused = statistics.median(r["fused_ms"])
            faults = "/".join(f"{statistics.median(f):.0f}" for f in (r["fused_faults"], r["store"]["faults"],
                                                                      r["graph"]["faults"]))
            speed_rows.append([alloc, r["dtype"], r["d_model"], r["layer"], f"{fused:.2f}",
                               _ci(r["store"]["over_fused"]), _ci(r["graph"]["over_fused"]), faults])
    tok = ", ".join(f"d={d}: {'x'.join(map(str, tokens(d)))}" for d in args.dims)
    print_table(f"B + W against one fused backward, per layer type ({args.blocks} GPT block(s); tokens {tok}), "
                "1 thread, median [95 % CI]", ["malloc", "dtype", "d", "layer", "fused ms", "B+W / fused (store)",
                                               "B+W / fused (graph)", "page faults fused/store/graph"],
                speed_rows)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    mem_rows = []
    for run in runs.values():
        for r in run["memory"]:
            for s, pk in r["peak_bytes_per_stage"].items():
                mem_rows.append([r["dtype"], r["d_model"], s, *(mib(pk[k]) for k in (
                    "stock 1F1B", "zb graph", "zb store", "stock 1F1B ckpt", "zb ckpt"))])
    print_table(f"peak activation MiB per stage, {STAGES} stages x {MICRO_BATCHES} micro-batches (ZB-H1 plan), "
                "from measured bytes per micro-batch", ["dtype", "d", "stage", "stock 1F1B", "zb graph", "zb store",
                                                        "stock 1F1B ckpt", "zb ckpt (store)"], mem_rows)
    write_json(args.out, {"benchmark": "split_backward", "heads": HEADS, "blocks": args.blocks,
                          "tokens": {d: tokens(d) for d in args.dims}, "stages": STAGES,
                          "micro_batches": MICRO_BATCHES, "runs": runs})
    return 0


def _ci(c: dict) -> str:
    return Interval(**c).text()


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
