"""Overhead of the delegated path when nothing is slow: every link delegated vs every link direct.

Same transport-level pipeline as ``delegation_hol.py`` (4 ranks, the engine's zb plan, 12 micro-batches,
emulated 10 ms F/B/W ops, real tensors exchanged through ``transports.build_transport``), no delay,
activations (and gradients) of 1 MiB and 16 MiB. The two modes alternate at iteration boundaries
(``set_link_mode``) so they share the machine's load; the ratio of median iteration times is
reported (target: delegated at most 5 % slower). Each size runs under glibc's default malloc and
under settings that keep freed memory (``--allocators``): with the default, fresh 16 MiB tensors
fault in their pages on every message, which slows the direct path more than the delegated one.
``--ablate`` adds all-delegated modes that skip the sender's staging copy, the receiver's, or both
(``_copy_ablation.py``: time only, the data arrives as garbage), to show what those two copies cost.

    DS_ACCELERATOR=cpu python benchmarks/transport/delegation_overhead.py [--rounds 8] [--ablate] [--out out/delegation_overhead.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # delegation_hol
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

import _copy_ablation
from _util import CACHING_MALLOC, print_table, write_json
from delegation_hol import MICROBATCHES, OP_MS, STAGES, launch, load, ms


ALLOCATORS = {"glibc": {}, "caching": CACHING_MALLOC}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="measured iterations per mode (modes interleaved)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--queues", type=int, default=2)
    ap.add_argument("--slot-mib", type=int, default=None,
                    help="delegation.slot_mb (default: the config's); smaller than a message = several pieces")
    ap.add_argument("--slots", type=int, default=None, help="delegation.slots (default: the config's)")
    ap.add_argument("--allocators", default="glibc,caching",
                    help="glibc (this machine's default malloc), caching (keeps freed memory, as GPU caching "
                         "allocators do: no page faults to hide the copies behind)")
    ap.add_argument("--ablate", action="store_true",
                    help="also run all-delegated modes without the send copy, the receive copy, or both (time only)")
    ap.add_argument("--out", default="out/delegation_overhead.json")
    a = ap.parse_args()
    allocators = a.allocators.split(",")
    unknown = [al for al in allocators if al not in ALLOCATORS]
    if unknown:
        ap.error(f"--allocators: unknown '{unknown[0]}'; use a comma-separated list of {', '.join(ALLOCATORS)}")
    modes = ["direct", "delegated-all"] + (_copy_ablation.MODES if a.ablate else [])
    from ds_pipemorph.runtime.config import PipeMorphConfig

    slot_mb = a.slot_mib or PipeMorphConfig().delegation.slot_mb
    runs, table, ablation = [], [], []
    for alloc, mib in [(al, mib) for al in allocators for mib in a.sizes_mib]:
        for k in CACHING_MALLOC:  # the rank processes are spawned: they start with this environment
            os.environ.pop(k, None)
        os.environ.update(ALLOCATORS[alloc])
        load_before = load()
        per_rank = launch(modes, a.rounds, a.warmup, 0.0, mib * (1 << 20) // 4, OP_MS, a.queues,
                          delegation={k: v for k, v in (("slot_mb", a.slot_mib), ("slots", a.slots)) if v})
        it = {m: per_rank[0][0][m]["iter_s"] for m in modes}
        med = {m: statistics.median(v) for m, v in it.items()}
        ratio = med["delegated-all"] / med["direct"]
        # Per-round ratios (the two modes of one round ran back to back) are less sensitive to load drift.
        paired_of = {m: statistics.median(g / d for d, g in zip(it["direct"], it[m])) for m in modes[1:]}
        paired = paired_of["delegated-all"]
        # Share of this machine's cores busy (any process) during rank 0's iterations: near 1 means
        # the run is bound by CPU, where every extra copy of the delegated path shows in full.
        busy = {m: round(statistics.median(per_rank[0][0][m]["cpu_busy"]), 3) for m in modes}
        faults = {m: statistics.median(per_rank[0][0][m]["page_faults"]) for m in modes}  # whole machine
        load_after = load()
        runs.append(dict(allocator=alloc, message_mib=mib, iteration_ms={m: [ms(x) for x in v] for m, v in it.items()},
                         median_ms={m: ms(v) for m, v in med.items()}, ratio_of_medians=round(ratio, 4),
                         median_paired_ratio=round(paired, 4),
                         median_paired_ratio_by_mode={m: round(v, 4) for m, v in paired_of.items()}, cpu_busy_median=busy, page_faults_median=faults, load_before=load_before, load_after=load_after))
        table.append([alloc, mib, ms(med["direct"]), ms(med["delegated-all"]), f"{ratio:.3f}", f"{paired:.3f}",
                      f"{busy['direct']:.0%} / {busy['delegated-all']:.0%}",
                      f"{faults['direct']:.0f} / {faults['delegated-all']:.0f}", f"{load_before[0]} -> {load_after[0]}"])
        if a.ablate:
            ablation.append([alloc, mib, *(f"{paired_of[m]:.3f}" for m in modes[1:])])
    print_table(f"ZB-H1, {STAGES} stages x {MICROBATCHES} mb, {OP_MS:g} ms ops, no delay, {a.queues} queues, "
                f"{slot_mb} MiB staging slots, medians over {a.rounds} iterations per mode",
                ["malloc", "message MiB", "direct ms", "delegated ms", "ratio (medians)", "ratio (paired median)",
                 "CPU busy direct / delegated", "page faults direct / delegated", "load 1-min"], table)
    if a.ablate:
        print_table("What the staging copies cost: each all-delegated mode / direct (paired median over rounds; "
                    "modes without a copy deliver garbage, they measure time only)",
                    ["malloc", "message MiB", *modes[1:]], ablation)
    write_json(a.out, dict(benchmark="delegation_overhead", pipeline="transport-level (the transports without DeepSpeed; pipemorph bench measures them in the engine)",
                           plan="the engine's zb plan (ZB-H1 warm-up, build_plan), 12 micro-batches", stages=STAGES, op_ms=OP_MS,
                           queues=a.queues, slot_mb=slot_mb, rounds=a.rounds, ablate=a.ablate, runs=runs, target="delegated <= 1.05 x direct"))


if __name__ == "__main__":
    main()
