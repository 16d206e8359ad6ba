"""The split backward on the GPT recipe's block: its cost against one fused backward, and the
activation bytes a stage holds, with and without activation checkpointing.

    python benchmarks/split_backward.py [--dims 256 512] [--pairs 15] [--blocks 2] [--out FILE]

One process, one intra-op thread. Per dtype (fp32, bf16) and model width d (4 heads, FFN 4d, batch
4 x 128 tokens), a stage of ``--blocks`` blocks:

- **B + W / fused**: each pair runs one micro-batch's forward then a fused backward
  (``torch.autograd.backward``) and another forward then B (``bw_split.backward_input``) + W
  (``WeightGradWork.run``), in alternating order; the row is the median of the per-pair ratios with
  its 95 % bootstrap interval (``bench.paired``).
- **activation bytes per micro-batch**, measured: the bytes of the distinct tensor storages autograd
  keeps for one micro-batch (the stage's input and parameters not counted: every schedule holds them) (a ``saved_tensors_hooks`` pack hook sees each saved tensor; a storage
  counts while a tensor saved from it is alive): after F (what F leaves for B), after B (what B
  leaves for W). ``ckpt``: every block checkpointed as the engine does (``runtime.recompute``);
  ``stock ckpt``: DeepSpeed's reentrant ``checkpointing.checkpoint``, whose backward is fused (it keeps
  each chunk's input on its ctx, where the hook cannot see it: counted as the chunks' input sizes).
- **peak per stage**, computed from those measured bytes for a 4-stage job of 8 micro-batches: at
  each point of the stage's op order, (micro-batches between F and B) x after-F bytes + (between B
  and W) x after-B bytes; stock 1F1B holds S - s micro-batches of after-F bytes (fused backward).

Prints the tables and writes JSON (default ``split_backward.json``).
"""
from __future__ import annotations

import argparse
import sys
import time
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "recipes" / "gpt"))

import torch  # noqa: E402

from _util import exit_on_bad_input, print_table, write_json  # noqa: E402
from ds_pipemorph.bench.paired import bootstrap_median  # noqa: E402
from ds_pipemorph.plan.ir.profile import Costs  # noqa: E402
from ds_pipemorph.plan.sched.baselines import zb_h1  # noqa: E402
from ds_pipemorph.runtime.bw_split import backward_input  # noqa: E402
from ds_pipemorph.runtime.recompute import Recompute, split_checkpoint  # noqa: E402
from model import Block  # noqa: E402

BATCH, SEQ, HEADS = 4, 128, 4
STAGES, MICRO_BATCHES = 4, 8


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


class HeldBytes:
    """Bytes of the distinct storages of the tensors autograd saved, counted while they live."""

    def __init__(self):
        self.saved: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (tensor, storage bytes, storage)

    def pack(self, t):
        self.saved[id(t)] = (weakref.ref(t), t.untyped_storage().nbytes(), t.untyped_storage().data_ptr())
        return t

    def live(self) -> int:
        storages = {}
        for ref, nbytes, ptr in self.saved.values():
            if ref() is not None:
                storages[ptr] = nbytes
        return sum(storages.values())


def _input(d, dtype):
    return torch.randn(BATCH, SEQ, d, dtype=dtype, requires_grad=True)


def fused_ms(stage, d, dtype) -> float:
    x = _input(d, dtype)
    out = stage(x)
    g = torch.randn_like(out)
    t = time.perf_counter()
    torch.autograd.backward(out, g)
    return (time.perf_counter() - t) * 1e3


def split_ms(stage, d, dtype) -> float:
    x = _input(d, dtype)
    out = stage(x)
    g = torch.randn_like(out)
    params = [p for p in stage.parameters()]
    t = time.perf_counter()
    with Recompute(params) as chunks:
        _, work = backward_input([out], [g], [x], params)
    for w in [work, *chunks.works]:
        w.run()
    return (time.perf_counter() - t) * 1e3


def bytes_held(stage, d, dtype) -> tuple[int, int]:
    """(after F, after B) bytes for one micro-batch; the input and output themselves not counted."""
    held = HeldBytes()
    params = [p for p in stage.parameters()]
    with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
        x = _input(d, dtype)
        out = stage(x)
        param_ids = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
        after_f = held.live() - _counted(held, param_ids)
        if stage.ckpt == "stock":  # fused backward: nothing is left between B and W
            # DeepSpeed's checkpoint keeps each chunk's input on its ctx, out of the hook's sight:
            # the same tensors as ours keeps, counted here from the chunks' inputs.
            return (len(stage.blocks) - 1) * x.numel() * x.element_size(), 0  # the first one is the stage input
        with Recompute(params) as chunks:
            _, work = backward_input([out], [torch.ones_like(out)], [x], params)
        works = [work, *chunks.works]
        del out
        after_b = held.live() - _counted(held, param_ids)
        for w in works:
            w.run()
    return after_f, after_b


def _counted(held: HeldBytes, ptrs: set) -> int:
    """Bytes of the parameters and the stage input among the live storages (not activations)."""
    seen = {}
    for ref, nbytes, ptr in held.saved.values():
        if ref() is not None and ptr in ptrs:
            seen[ptr] = nbytes
    return sum(seen.values())


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--out", default="split_backward.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plan = zb_h1(Costs.uniform(STAGES), MICRO_BATCHES)
    speed_rows, mem_rows, results = [], [], []
    for dtype in (torch.float32, torch.bfloat16):
        for d in args.dims:
            stage = Stage(d, args.blocks, dtype)
            for _ in range(2):  # warm-up
                fused_ms(stage, d, dtype), split_ms(stage, d, dtype)
            pairs = []
            for i in range(args.pairs):
                if i % 2:
                    s, f = split_ms(stage, d, dtype), fused_ms(stage, d, dtype)
                else:
                    f, s = fused_ms(stage, d, dtype), split_ms(stage, d, dtype)
                pairs.append((f, s))
            ci = bootstrap_median([s / f for f, s in pairs])
            name = str(dtype).replace("torch.", "")
            fused_med = sorted(f for f, _ in pairs)[len(pairs) // 2]
            speed_rows.append([name, d, f"{fused_med:.1f}", ci.text()])
            mem = {}
            for ckpt in (None, "ours", "stock"):
                st = Stage(d, args.blocks, dtype, ckpt)
                st.load_state_dict(stage.state_dict())
                mem[ckpt or "none"] = bytes_held(st, d, dtype)
            mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
            peaks = {}
            for s in range(STAGES):
                ops = plan[s]
                peaks[s] = {"zb": peak_bytes(ops, *mem["none"]), "zb ckpt": peak_bytes(ops, *mem["ours"]),
                            "stock 1F1B": (STAGES - s) * mem["none"][0],
                            "stock 1F1B ckpt": (STAGES - s) * mem["stock"][0]}
                mem_rows.append([name, d, s, *(mib(peaks[s][k]) for k in ("stock 1F1B", "zb", "stock 1F1B ckpt",
                                                                          "zb ckpt"))])
            results.append({"dtype": name, "d_model": d, "blocks": args.blocks, "pairs": len(pairs),
                            "fused_ms": [round(f, 3) for f, _ in pairs], "split_ms": [round(s, 3) for _, s in pairs],
                            "split_over_fused": {"median": ci.median, "lo": ci.lo, "hi": ci.hi},
                            "bytes_per_micro_batch": {k: {"after_F": v[0], "after_B": v[1]} for k, v in mem.items()},
                            "peak_bytes_per_stage": peaks})
    print_table(f"B + W against one fused backward, {args.blocks} GPT blocks, batch {BATCH} x {SEQ}, 1 thread",
                ["dtype", "d", "fused ms (median)", "B+W / fused [95 % CI]"], speed_rows)
    print_table(f"peak activation MiB per stage, {STAGES} stages x {MICRO_BATCHES} micro-batches (ZB-H1 plan), "
                "from measured bytes per micro-batch", ["dtype", "d", "stage", "stock 1F1B", "zb", "stock 1F1B ckpt",
                                                        "zb ckpt"], mem_rows)
    write_json(args.out, {"benchmark": "split_backward", "batch": BATCH, "seq": SEQ, "heads": HEADS,
                          "stages": STAGES, "micro_batches": MICRO_BATCHES, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
