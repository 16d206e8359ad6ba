"""Head-of-line blocking on a slow last link: direct vs delegated transport, same ZB-H1 plan.

A transport-level pipeline (the transports alone, without DeepSpeed around them; ``pipemorph bench``
measures the same paths inside the engine): 4 ranks, each runs its stage's part of the engine's
``zb`` plan (ZB-H1 warm-up, ``runtime.plans.build_plan``, 12 micro-batches, planned for equal 10 ms
ops) with emulated ops (10 ms per F/B/W: tiny real math, then sleep, holding no CPU) and
exchanges real activation/gradient tensors through ``transports.build_transport``; 30 ms are injected
on the last link. Link modes rotate at iteration boundaries (``set_link_mode``) so that every mode sees
the same machine load: ``direct`` (DelayInjector: FIFO with one message in flight), ``delegated-slow``
(only the slow link delegated, as PipeMorph does) and ``delegated-all``. Reported per mode (medians
over iterations): iteration time (barrier to the last rank's ``wait_sends``), and the time a sender
spends inside ``send`` per message on the slow link (stage 2 sending F, stage 3 sending B).

    DS_ACCELERATOR=cpu python benchmarks/transport/delegation_hol.py [--rounds 6] [--out out/delegation_hol.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import print_table, write_json
from ds_pipemorph.procs import free_port

STAGES, MICROBATCHES, OP_MS = 4, 12, 10.0


def zb_plan(stages: int, microbatches: int, op_ms: float) -> list[list[tuple[str, int]]]:
    """The plan the engine runs for ``schedule: zb`` (planned for 10 ms ops; ``op_ms`` is the same)."""
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    return [[(op.kind, op.mb) for op in row] for row in build_plan(parse_config({"schedule": "zb"}), stages,
                                                                    microbatches)]


def _op(ms: float, x):
    start = time.perf_counter()
    y = x @ x  # tiny real math
    left = start + ms / 1000.0 - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return y


def run_iteration(tr, stage: int, plan_row, act_numel: int, op_ms: float, slow_link: int, check: bool = True):
    """One iteration of this stage's plan; returns the seconds spent in ``send`` per slow-link message.
    ``check``: assert that every received message carries its micro-batch (off in copy ablations)."""
    import torch

    last = STAGES - 1
    small = torch.randn(8, 8)
    slow_sends = []
    order = {k: [mb for kk, mb in plan_row if kk == k] for k in "FB"}
    want = {"F": [mb for mb in order["F"]] if stage > 0 else [], "B": [mb for mb in order["B"]] if stage < last else []}
    for k in "FB":  # one receive posted ahead per kind, as the engine does
        if want[k]:
            tr.post_recv(k, want[k][0])
    for kind, mb in plan_row:
        if kind == "W":
            _op(op_ms, small)
            continue
        if want[kind] and want[kind][0] == mb:
            x = tr.recv(kind, mb)
            want[kind].pop(0)
            if want[kind]:
                tr.post_recv(kind, want[kind][0])
            assert not check or float(x[0]) == mb, f"stage {stage}: {kind}{mb} carried {float(x[0])}"
        _op(op_ms, small)
        send = (kind == "F" and stage < last) or (kind == "B" and stage > 0)
        if send:
            out = torch.full((act_numel,), float(mb))
            t = time.perf_counter()
            tr.send(kind, mb, out)
            dt = time.perf_counter() - t
            link = stage if kind == "F" else stage - 1
            if link == slow_link:
                slow_sends.append(dt)
    tr.wait_sends()
    return slow_sends


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores of this machine, from /proc/stat (Linux; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def page_faults() -> int:
    """Page faults of the whole machine so far, from /proc/vmstat (Linux; 0 elsewhere)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("pgfault "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rank_main(rank: int, world: int, port: int, out, modes: list[str], rounds: int, warmup: int,
              delay_ms: float, act_numel: int, op_ms: float, queues: int, delegation: dict | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import _copy_ablation
    from ds_pipemorph.runtime.config import PipeMorphConfig
    from ds_pipemorph.runtime.transport.router import build_transport

    torch.set_num_threads(1)
    _copy_ablation.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    slow = world - 2
    links = {str(slow): {"delay_ms": delay_ms}} if delay_ms > 0 else {}
    cfg = PipeMorphConfig.model_validate({"delegation": {"mode": "auto", "queues": queues, **(delegation or {})},
                                          "inject": {"links": links}, "timeout_s": 120.0})
    tr = build_transport(cfg, rank, rank, list(range(world)), None, {})
    plan = zb_plan(world, MICROBATCHES, op_ms)[rank]
    layouts = {"direct": {}, "delegated-slow": {slow: "delegated"},
               **{m: {i: "delegated" for i in range(world - 1)} for m in _copy_ablation.SKIPS}}
    results = {m: {"iter_s": [], "send_s": [], "cpu_busy": [], "page_faults": []} for m in modes}
    try:
        for rnd in range(warmup + rounds):
            for mode in modes:
                for link in range(world - 1):
                    tr.set_link_mode(link, layouts[mode].get(link, "direct"))
                tr.delegated.wait_ready(120.0)
                intact = _copy_ablation.select(mode)  # the previous mode's copies all ended in its wait_sends
                dist.barrier()
                p0, c0, t0 = page_faults(), cpu_times(), time.perf_counter()
                sends = run_iteration(tr, rank, plan, act_numel, op_ms, slow, check=intact)
                dt, c1, p1 = time.perf_counter() - t0, cpu_times(), page_faults()
                t = torch.tensor([dt])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rnd >= warmup:
                    results[mode]["iter_s"].append(float(t))
                    results[mode]["send_s"].extend(sends)
                    # share of the machine's cores busy during this rank's iteration (any process)
                    results[mode]["cpu_busy"].append((c1[0] - c0[0]) / max(1, c1[1] - c0[1]))
                    results[mode]["page_faults"].append(p1 - p0)
        out.put((rank, results, list(tr.events) + list(tr.delegated.events)))
    finally:
        tr.close()
        dist.barrier()
        dist.destroy_process_group()


def launch(modes, rounds, warmup, delay_ms, act_numel, op_ms, queues, timeout=900.0, delegation=None):
    """``delegation``: more keys of the ds_config's ``pipemorph.delegation`` (e.g. ``slot_mb``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, STAGES, port, out, modes, rounds, warmup, delay_ms, act_numel,
                                                 op_ms, queues, delegation)) for r in range(STAGES)]
    for p in procs:
        p.start()
    per_rank = {}
    try:
        for _ in range(STAGES):
            r, res, events = out.get(timeout=timeout)
            per_rank[r] = (res, events)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return per_rank


def ms(x: float) -> float:
    return round(x * 1000.0, 2)


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def summarize(per_rank, modes, slow_link: int) -> dict:
    rows = {}
    for mode in modes:
        iters = per_rank[0][0][mode]["iter_s"]  # all-reduced: the same on every rank
        sends = per_rank[slow_link][0][mode]["send_s"] + per_rank[slow_link + 1][0][mode]["send_s"]
        rows[mode] = dict(iteration_ms_median=ms(statistics.median(iters)), iteration_ms=[ms(v) for v in iters],
                          slow_link_send_ms_median=ms(statistics.median(sends)),
                          slow_link_send_ms_mean=ms(statistics.mean(sends)),
                          slow_link_send_ms_max=ms(max(sends)), slow_link_messages=len(sends),
                          slow_link_blocked_ms_per_iteration=ms(sum(sends) / len(iters)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="measured iterations per mode (modes interleaved)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[30.0], help="delay on the last link; one run each")
    ap.add_argument("--queues", type=int, default=2)
    ap.add_argument("--act-kb", type=int, default=64, help="activation/gradient size in KiB")
    ap.add_argument("--out", default="out/delegation_hol.json")
    a = ap.parse_args()
    modes = ["direct", "delegated-slow", "delegated-all"]
    slow = STAGES - 2
    runs, table, events = [], [], set()
    for delay in a.delays_ms:
        load_before = load()
        per_rank = launch(modes, a.rounds, a.warmup, delay, a.act_kb * 256, OP_MS, a.queues)
        rows = summarize(per_rank, modes, slow)
        runs.append(dict(delay_ms=delay, load_before=load_before, load_after=load(), modes=rows))
        events |= {e for _, (_, ev) in per_rank.items() for e in ev}
        for mode in modes:
            r = rows[mode]
            table.append([f"{delay:g}", mode, r["iteration_ms_median"], r["slow_link_send_ms_median"],
                          r["slow_link_send_ms_mean"], r["slow_link_send_ms_max"],
                          r["slow_link_blocked_ms_per_iteration"], f"{load_before[0]} -> {runs[-1]['load_after'][0]}"])
    print_table(f"ZB-H1, {STAGES} stages x {MICROBATCHES} mb, {OP_MS:g} ms ops, delay on link {slow}, {a.queues} queues, "
                f"{a.act_kb} KiB messages, medians over {a.rounds} iterations per mode",
                ["delay ms", "mode", "iter ms", "send ms/msg slow link (median)", "(mean)", "(max)",
                 "blocked ms/iter", "load 1-min"], table)
    write_json(a.out, dict(benchmark="delegation_hol", pipeline="transport-level (the transports without DeepSpeed; pipemorph bench measures them in the engine)",
                           plan="the engine's zb plan (ZB-H1 warm-up, build_plan), 12 micro-batches", stages=STAGES,
                           op_ms=OP_MS, queues=a.queues, message_kib=a.act_kb, rounds=a.rounds, runs=runs,
                           events=sorted(events)))


if __name__ == "__main__":
    main()
