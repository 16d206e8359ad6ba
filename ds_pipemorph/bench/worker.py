"""The rank side of ``pipemorph bench``: started by torchrun, one rank per stage, one host.

For every scenario (a delay per link, injected as docs/design.md models a slow link) it trains each
schedule for ``warmup + iterations`` iterations on an emulated pipeline (F, B, W each take
``op_ms``, real tiny math) and records per iteration the time from a barrier before
``train_batch`` to the last rank's return. The PipeMorph row is the engine's ``adaptive`` schedule
with its control loop: it measures ops and links itself and re-plans (never reading the injection
settings); the warm-up iterations give it time to act, and its row also reports what that control
loop cost (``profiler_overhead``). Rank 0 writes the results as JSON, and after every iteration
appends one JSON line to ``spec.progress_file`` (``progress_line``, outside the timed span) that
the parent shows as progress.

A scenario with a delay trace replays it on every row from t = 0 at that row's first iteration
(warm-up included): one epoch for all ranks, taken by rank 0 after a barrier and broadcast (one
host: one monotonic clock), set on the engine's delay schedule (its delegates read it from there)
and on the stock engine's patch alike. Should delegates that started with the engine (the
delegation-only row) have taken an epoch already, that one stays, and how far it was before the
first iteration is reported (``trace_skew_s``, 0 when every row starts together).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..fileio import load_model, write_atomic
from ..plan.ir.links import DIRECT, Delegated
from ..plan.ir.lower import Dispatch
from ..plan.ir.profile import Costs
from ..plan.sched.baselines import deepspeed_1f1b
from ..plan.sim.simulate import replay
from ..runtime.shutdown import exit_process
from ..inject.delays import DelaySchedule, load_trace
from . import plain_sleep, stage_time
from .spec import BenchSpec, Scenario
from .summary import summarize

# The emulated stage's own F, B and W with --vary: the variation's table sets each op's time.
VARIED_OP_MS = 0.1


def build_engine(spec: BenchSpec, schedule: str, sc: Scenario, dispatch: Dispatch = Dispatch.ORDERED):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_pipemorph
    from ds_pipemorph.inject.emulated import EmulatedStage, anchor_stock_engine

    torch.manual_seed(0)
    t = VARIED_OP_MS if spec.vary else spec.op_ms  # with --vary, the injector makes each op last its table's time
    if spec.workload == plain_sleep.NAME:  # its ops sleep their own times: no injector, no anchor
        layers = plain_sleep.layers(spec.stages, spec.op_ms)
    else:
        layers = [LayerSpec(EmulatedStage, 8, t, t, t) for _ in range(spec.stages)]
    model = PipelineModule(layers=layers, num_stages=spec.stages, loss_fn=torch.nn.MSELoss(),
                           partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": spec.microbatches,
           "train_batch_size": spec.microbatches, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
           "steps_per_print": 10**9}
    if schedule == "stock-1f1b":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if spec.workload is not None:
            return engine
        anchor_stock_engine(engine)  # emulated ops count from the instruction's start, as in ours
        if spec.vary:
            from ..plan.sim.variation import vary_tables
            from ..inject.vary import install_stock

            install_stock(engine, vary_tables(spec.vary, Costs.uniform(spec.stages, spec.op_ms), spec.microbatches),
                          spec.microbatches)
        return engine
    if sc.trace:
        inject = {"trace": sc.trace}
    else:
        inject = {"links": {str(i): {"delay_ms": c} for i, c in enumerate(sc.links_ms) if c > 0}}
    delegation = {"zb": "off", "zb-delegated": "always", "pipemorph": "auto"}[schedule]
    section = {"schedule": "adaptive" if schedule == "pipemorph" else "zb", "delegation": {"mode": delegation},
               "adapt": {"enabled": schedule == "pipemorph"}, "inject": inject, "nvtx": False, "dispatch": dispatch,
               "memory": {"budget": spec.budget}}
    cfg["pipemorph"] = section
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if spec.vary:
        from ..plan.sim.variation import vary_tables
        from ..inject.vary import install

        install(engine, vary_tables(spec.vary, Costs.uniform(spec.stages, spec.op_ms), spec.microbatches))
    return engine


def start_trace(engine, stock: DelaySchedule | None, delegates_started: bool) -> float:
    """Put t = 0 of the delay trace here, on every rank (collective). Delegates started with the engine
    (``delegates_started``) copied its epoch already: that one stays (both paths of a link must agree)
    and the seconds it leads by are returned, max over ranks (else 0)."""
    dist.barrier()
    epoch = torch.tensor([time.monotonic()], dtype=torch.float64)
    dist.broadcast(epoch, 0)
    t0 = epoch.item()
    skew = 0.0
    transport = getattr(engine, "transport", None)
    schedules = {id(d): d for d in (stock, getattr(getattr(transport, "direct", None), "delays", None),
                                    getattr(getattr(transport, "delegated", None), "delays", None)) if d is not None}
    for d in schedules.values():
        if delegates_started and d._t0 is not None:
            skew = max(skew, t0 - d._t0)
        else:  # a send during start-up may have started it: the trace starts now
            d._t0 = t0
    lead = torch.tensor([skew], dtype=torch.float64)
    dist.all_reduce(lead, op=dist.ReduceOp.MAX)
    return lead.item()


def measure(spec: BenchSpec, engine, done: Optional[Callable[[int], None]] = None,
            kept: Optional[list] = None) -> list[float]:
    """Iteration times in ms of the measured iterations; ``done(i)`` after iteration i (0-based, warm-up
    included) on every rank, outside the timed span. ``kept``: gets this rank's
    ``stage_time.StageIteration`` of each measured iteration (our engine only)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)) for _ in range(spec.microbatches)]
    inbox = getattr(engine, "inbox", None) if kept is not None else None  # ready dispatch's
    spent = _time_inbox(inbox) if inbox is not None else None
    out = []
    for i in range(spec.warmup + spec.iterations):
        if spec.workload == plain_sleep.NAME:
            data = plain_sleep.batch(i, spec.microbatches)
        settled = inbox.settled_ns if inbox is not None else 0
        if spent is not None:
            spent.update(dict.fromkeys(spent, 0))
        dist.barrier()
        t0 = time.monotonic_ns()
        engine.train_batch(iter(data))
        span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        if i >= spec.warmup:
            out.append((span[0].item() + span[1].item()) / 1e6)
            if kept is not None:
                kept.append(stage_time.keep(engine.op_records, engine.choosing_ns[-1] if inbox else 0,
                                            inbox.settled_ns - settled if inbox else 0, spent or {}))
        if done is not None:
            done(i)
    return out


TIMED_INBOX = ("post", "wait_for", "wait_any")  # posting, holding for a message, sleeping with no op ready


def _time_inbox(inbox) -> dict[str, int]:
    """Count the ns each of ``inbox``'s ``TIMED_INBOX`` methods takes (this instance only) into the
    returned dict, by method name."""
    total = dict.fromkeys((*TIMED_INBOX, "wait_for_in_vain"), 0)  # in vain: a hold whose message did not come

    def timed(name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter_ns()
            came = None
            try:
                came = fn(*args, **kwargs)
                return came
            finally:
                total[name] += time.perf_counter_ns() - t
                if name == "wait_for" and not came:
                    total["wait_for_in_vain"] += time.perf_counter_ns() - t
        return run
    for name in TIMED_INBOX:
        setattr(inbox, name, timed(name, getattr(inbox, name)))
    return total


def op_tables(spec: BenchSpec, costs: Costs):
    """Iteration k -> its per-op times (None: the costs'), as the replay takes them."""
    if spec.workload == plain_sleep.NAME:
        return lambda k: plain_sleep.op_times(k, spec.stages, spec.microbatches, spec.op_ms)
    if spec.vary:
        from ..plan.sim.variation import vary_tables

        return vary_tables(spec.vary, costs, spec.microbatches)
    return lambda k: None


def stage_times(spec: BenchSpec, schedule: str, dispatch: Dispatch, engine, kept: list,
                costs: Costs) -> Optional[tuple[list[dict], float, float]]:
    """Rank 0: per stage, ``stage_time.FIELDS`` as means over the measured iterations; the mean replay
    of each iteration with the times its ops really took, and the same with each link's measured mean
    message latency added to its delay (collective)."""
    from ..plan.ir.ops import peak_inflight
    from ..plan.sim.ready import replay_varying

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, kept)
    if dist.get_rank() != 0:
        return None
    tables = op_tables(spec, costs)
    def replay(times, links=None):
        return replay_varying(engine.plan, costs, spec.microbatches, dispatch=dispatch, caps=peak_inflight(engine.plan),
                              op_times=times, link_delays=links, link_model=_link_model(schedule, engine))

    rows, as_ran, with_latency = [], [], []
    for j, k in enumerate(range(spec.warmup, spec.warmup + spec.iterations)):
        per_stage = [g[j] for g in gathered]
        rows.append(stage_time.account(per_stage, replay(tables(k)), costs.links))
        measured = stage_time.measured_op_times(per_stage)
        as_ran.append(replay(measured).iteration_ms)
        latency = [c + lat for c, lat in zip(costs.links, stage_time.link_latency(per_stage))]
        with_latency.append(replay(measured, latency).iteration_ms)
    n = len(as_ran)
    return stage_time.mean(rows), sum(as_ran) / n, sum(with_latency) / n


def progress_line(row: int, rows: int, scenario: int, scenarios: int, name: str, schedule: str,
                  iteration: int, spec: BenchSpec) -> str:
    """One line of the progress file: where the run is (1-based counts), as JSON."""
    return json.dumps({"row": row, "rows": rows, "scenario": scenario, "scenarios": scenarios, "name": name,
                       "schedule": schedule, "iteration": iteration, "iterations": spec.warmup + spec.iterations,
                       "warmup": iteration <= spec.warmup}) + "\n"


def append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)


def predicted_ms(spec: BenchSpec, schedule: str, costs: Costs, engine, dispatch: Dispatch = Dispatch.ORDERED) -> float:
    """The replay simulator's time for the plan the schedule ran last, under the injected delays; slow
    links on the direct path are modelled as such (one message in flight, the sender blocks). With
    --vary or ready dispatch: the mean over the measured iterations of ``plan.sim.ready``'s replay of
    each iteration's op times under that dispatch (caps: the plan's peak, as the engine holds)."""
    S, N = spec.stages, spec.microbatches
    if spec.vary or spec.workload or dispatch is Dispatch.READY:
        from ..plan.ir.ops import peak_inflight
        from ..plan.sim.ready import replay_varying

        tables = op_tables(spec, costs)
        ks = range(spec.warmup, spec.warmup + spec.iterations)
        if schedule == "stock-1f1b":  # DeepSpeed's order, its backward fused
            plan = deepspeed_1f1b(S, N)
            return sum(replay_varying(plan, costs, N, dispatch=Dispatch.ORDERED, op_times=tables(k),
                                      fused_backward=True, link_model=DIRECT).iteration_ms for k in ks) / len(ks)
        model = _link_model(schedule, engine)
        return sum(replay_varying(engine.plan, costs, N, dispatch=dispatch, caps=peak_inflight(engine.plan),
                                  op_times=tables(k), link_model=model).iteration_ms for k in ks) / len(ks)
    if schedule == "stock-1f1b":
        return replay(deepspeed_1f1b(S, N), costs, N, fused_backward=True, link_model=DIRECT).iteration_ms
    if schedule == "zb-delegated":  # every link: k FIFOs served by delegates, the sender never blocks
        return replay(engine.plan, costs, N, link_model=Delegated(engine.transport.queues_of(0))).iteration_ms
    if schedule == "pipemorph":  # "auto": links the control loop moved to delegates, with their queues
        return replay(engine.plan, costs, N, link_model=engine.adapter.policy.link_model()).iteration_ms
    return replay(engine.plan, costs, N, link_model=DIRECT).iteration_ms


def _link_model(schedule: str, engine):
    if schedule == "zb-delegated":
        return Delegated(engine.transport.queues_of(0))
    if schedule == "pipemorph":
        return engine.adapter.policy.link_model()
    return DIRECT


def ratios_to_pipemorph(results: list[dict]) -> dict:
    """Per scenario with a PipeMorph row: every schedule's mean iteration time over PipeMorph's."""
    out = {}
    for name in dict.fromkeys(r["scenario"] for r in results):
        mine = {r["schedule"]: r for r in results if r["scenario"] == name and r.get("dispatch", Dispatch.ORDERED) == Dispatch.ORDERED}
        if "pipemorph" in mine:
            out[name] = {k: round(r["mean_ms"] / mine["pipemorph"]["mean_ms"], 3) for k, r in mine.items()}
    return out


def main(spec_path: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    spec = load_model(spec_path, BenchSpec)
    from ..staging.builder import prepare_comm_op

    prepare_comm_op()  # DeepSpeed's CPU collectives op, loaded under the build guard before init_distributed does
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    results, step, total = [], 0, len(spec.scenarios) * len(spec.rows())
    for k, sc in enumerate(spec.scenarios):
        trace = load_trace(sc.trace, spec.stages - 1) if sc.trace else None
        costs = Costs.uniform(spec.stages, spec.op_ms, sc.links_ms)  # a trace's: its mean delays
        for schedule, dispatch in spec.rows():
            patch, stock_delays = None, None
            if schedule == "stock-1f1b" and (trace is not None or any(sc.links_ms)):
                from ..inject.stock import install

                stock_delays = DelaySchedule(sc.links_ms if trace is None else [0.0] * (spec.stages - 1), trace)
                patch = install(stock_delays)
            engine = build_engine(spec, schedule, sc, dispatch)
            skew = start_trace(engine, stock_delays, schedule == "zb-delegated") if trace is not None else 0.0
            label = f"{schedule}{'/ready' if dispatch is Dispatch.READY else ''}"

            def done(i: int) -> None:
                if rank == 0:
                    append(spec.progress_file, progress_line(step + 1, total, k + 1, len(spec.scenarios), sc.name,
                                                             label, i + 1, spec))

            # A receive's record ends when its thread has the message only under ready dispatch (ordered
            # dispatch receives on the training thread, after whatever op ran before): accounted there only.
            kept = [] if schedule != "stock-1f1b" and dispatch is Dispatch.READY else None
            times = measure(spec, engine, done, kept)
            predicted = predicted_ms(spec, schedule, costs, engine, dispatch)
            stages = stage_times(spec, schedule, dispatch, engine, kept, costs) if kept is not None else None
            choosing = list(getattr(engine, "choosing_ns", []))[spec.warmup:]
            adapter = getattr(engine, "adapter", None)
            replans = [vars(r) for r in adapter.replans] if adapter is not None else []
            kept = [{"iteration": i, "target_ms": tg} for i, tg in adapter.kept] if adapter is not None else []
            switch_ms = [None] * dist.get_world_size()  # every rank's: a rank switches only its own links
            dist.all_gather_object(switch_ms, getattr(engine, "switch_ms", []))
            overhead = adapter.overhead_report() if adapter is not None else None
            if patch:
                patch["drain"]()
                patch["uninstall"]()
            engine.destroy()
            del engine
            gc.collect()
            dist.barrier()
            step += 1
            if rank == 0:
                row = {"scenario": sc.name, "links_ms": sc.links_ms, "trace": sc.trace, "schedule": schedule,
                       "dispatch": dispatch, "budget": None if schedule == "stock-1f1b" else spec.budget,
                       **summarize(times), "predicted_ms": predicted, "replans": replans}
                if adapter is not None:
                    row["plans_kept"] = kept  # re-plan decisions that kept the plan in force
                    row["switch_ms"] = switch_ms  # (iteration, ms) moving links between transports after re-plans
                if trace is not None:
                    row["trace_skew_s"] = round(skew, 3)
                if dispatch is Dispatch.READY:  # rank 0's time choosing the next op, per op run
                    row["choosing_us_per_op"] = sum(choosing) / 1e3 / (3 * spec.microbatches * len(choosing))
                if stages is not None:  # per stage: where its time went (bench.stage_time)
                    row["stage_time_ms"], row["predicted_as_ran_ms"], row["predicted_as_ran_latency_ms"] = stages
                if overhead is not None:
                    row["profiler_overhead"] = overhead
                results.append(row)
    if rank == 0:
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "results": results,
                                           "ratios": ratios_to_pipemorph(results)}, indent=2))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # releases the groups while nothing holds them (``runtime.shutdown``)
