"""The control loop inside the engine (PipeMorph §6): measure, detect, re-plan — no oracle.

After every iteration each rank contributes what it measured itself: the median F, B and W times
of its stage (from the op records) and, per message of the iteration, when its sends ended and when
its receives started and ended (the op records again: nothing extra travels, and a slow or
delegated link is measured as training uses it). Every message's receive end minus its send end,
corrected by the clock offset between the two neighbours estimated at start-up, bounds its transit
from above, and is exact when the receiver was waiting before the message left; the link's delay is
the median of the exact samples of the iteration (both directions), see ``_link_delays``. (An
earlier version probed every link at every boundary with a stamped message after a barrier; on a
slow link that cost the link's delay per iteration, and a probe put into a one-message direct FIFO
delays the next real message.) The numbers are all-gathered, so every rank feeds the identical
detector the identical input; when it asks for a re-plan, rank 0 alone plans (a deterministic
search bounded by evaluations, not by time, or keeps the plan in force when, under the new delays
on the same slow links, it is within 2 % of the lower bound) and broadcasts the decision, which
every rank adopts at the next iteration. (Every rank planning the same thing cost four times the
CPU on a shared host, and the slowest rank set the pace.) Nothing here reads the injection settings.

Its own cost is measured as it runs (``overhead.Overhead``, one per iteration boundary and rank:
wall time in each part of this code, plus the per-op timestamps at a cost calibrated at start-up)
and shipped with the next iteration's all-gather, so every rank can report the cost on the
critical path (``overhead_report``; rank 0 logs it every ``LOG_EVERY`` iterations and in
``close``). With ``profile_out`` rank 0 writes the smoothed measurements as a profile file
(``profile_export``) at every re-plan and in ``close``.
"""
from __future__ import annotations

import atexit
import logging
import statistics
import time
from dataclasses import astuple, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..control.detector import DetectorConfig, LinkDetector
from ..plan.bounds import lower_bound_ms
from ..plan.links import DIRECT, LATENCY, Delegated
from ..plan.profile import Costs
from ..plan.queues import queues_needed
from ..plan.search import search
from ..plan.simulate import Schedule, replay, warmup_counts
from ..plan.tolerance import link_tolerances
from .overhead import OVERHEAD_FIELDS, Overhead, OverheadBook, stamp_cost_ns
from .profile_export import ProfileExport

logger = logging.getLogger(__name__)

REPLAN_EVALS = 2000
GROW_GAIN = 0.05  # add delegate queues to a running link only for a gain above this share of the iteration
KEEP_WITHIN = 0.02  # keep the plan in force when it is this close to the lower bound under new delays
# Links run on the direct transport: a slow one holds one message in flight and blocks its sender,
# so plans are scored with that model (a burst of warm-up sends costs what it costs on the wire).
HOL = True  # search effort per re-plan; an evaluation bound keeps every rank's plan identical
LOG_EVERY = 100  # rank 0 logs the profiler's overhead every this many iterations (and in close())
_LOCAL = 6  # columns of the all-gathered row before the overhead: stage, F, B, W, upstream rank, downstream rank
_TIMES = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")  # per-message blocks after the overhead (see _message_times)


@dataclass
class Replan:
    iteration: int  # decided after this iteration (0-based); in force from the next one
    measured_ms: list[Optional[float]]
    target_ms: list[float]
    predicted_ms: float
    warmup: list[int]
    plan: list[list[str]]


class Adapter:
    def __init__(self, stages: int, microbatches: int, stage_id: int, plan: Schedule, costs: Costs,
                 caps: Optional[list[int]], every: int, clock_offsets: dict[int, int],
                 delegation: str = "off", detector: DetectorConfig = DetectorConfig(),
                 profile_out: Optional[str] = None, neighbours: tuple[int, int] = (-1, -1),
                 queues: tuple[int, int] = (2, 2)):
        self.S, self.N, self.stage_id = stages, microbatches, stage_id
        self.caps = caps
        self.every = every
        self.clock_offsets = clock_offsets
        self.delegation = delegation
        self.neighbours = neighbours  # global ranks of stage s-1 and s+1 in this pipeline (-1: none)
        self.min_queues, self.max_queues = queues  # delegate FIFOs per delegated link direction
        self.link_queues = [self.min_queues] * (stages - 1)  # what each link has (or gets when delegated)
        self.costs = costs
        self.detector = LinkDetector(stages - 1, detector)
        tol = link_tolerances(plan, costs, microbatches, resolution_ms=0.1, link_model=self.model([0.0] * (stages - 1)))
        self.detector.adopt([0.0] * (stages - 1), [t.replay_ms for t in tol])
        self.iteration = -1
        self.replans: list[Replan] = []
        self.kept: list[tuple[int, list[float]]] = []  # (iteration, target) where the plan in force was kept
        self.plan_in_force = plan
        self.measured: list[list[Optional[float]]] = []  # per iteration, per link
        self.overheads: list[Overhead] = []  # this rank's, per iteration boundary
        self.overhead_book = OverheadBook()  # every rank's, one iteration behind
        self._stamp_ns = stamp_cost_ns()
        self._last_enter: Optional[int] = None
        self.profile_out = profile_out
        self.rank = dist.get_rank()
        self.export = ProfileExport(stages, microbatches, caps)
        self._closed = False
        atexit.register(self.close)  # the profile and the overhead line also when nobody calls close()

    def after_iteration(self, records, device_ms: Optional[dict[str, float]] = None) -> Optional[Schedule]:
        """Called on every rank at the same iteration boundary; returns the new plan or None."""
        enter = time.perf_counter_ns()
        period = -1.0 if self._last_enter is None else (enter - self._last_enter) / 1e6
        self._last_enter = enter
        self.iteration += 1
        oh = Overhead(stamps=len(records) * self._stamp_ns / 1e6)
        prev = self.overheads[-1] if self.overheads else None
        mine = self._local(records, oh, device_ms)
        shipped = list(astuple(prev)) if prev is not None else [-1.0] * len(OVERHEAD_FIELDS)
        t = time.perf_counter_ns()
        times = self._message_times(records)
        oh.links = _ms_since(t)
        mine = torch.cat([mine, torch.tensor([*shipped, period], dtype=torch.float64), times])
        t = time.perf_counter_ns()
        dist.barrier()  # waiting for the last rank to finish its iteration is not the loop's cost
        oh.sync = _ms_since(t)
        t = time.perf_counter_ns()
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone)  # rows: [stage, f, b, w, up rank, down rank, overhead..., period, times...]
        oh.exchange = _ms_since(t)
        try:
            if prev is not None:
                self.overhead_book.add(table[:, _LOCAL:_LOCAL + len(OVERHEAD_FIELDS) + 1])
            return self._decide(table, oh)
        finally:
            oh.other = max(0.0, _ms_since(enter) - (oh.counted() - oh.stamps) - oh.sync)
            self.overheads.append(oh)
            if self.rank == 0 and self.iteration and self.iteration % LOG_EVERY == 0:
                self._log_overhead()

    def _decide(self, table: torch.Tensor, oh: Overhead) -> Optional[Schedule]:
        t = time.perf_counter_ns()
        raw_f, raw_b, raw_w = self._raw_per_stage(table)
        oh.stats += _ms_since(t)
        t = time.perf_counter_ns()
        links = self._link_delays(table)
        oh.links += _ms_since(t)
        t = time.perf_counter_ns()
        f, b, w = (self._rounded(raw, old) for raw, old in ((raw_f, self.costs.f), (raw_b, self.costs.b),
                                                             (raw_w, self.costs.w)))
        self.measured.append(links)
        if self.iteration > 0:  # the first iteration exchanges layouts and warms up: not representative
            self.export.add(raw_f, raw_b, raw_w, links)
        oh.stats += _ms_since(t)
        if self.iteration == 0 or (self.iteration + 1) % self.every:
            return None
        t = time.perf_counter_ns()
        target = self.detector.observe(links)
        oh.detect = _ms_since(t)
        if target is None:
            return None
        t = time.perf_counter_ns()
        costs = Costs(f, b, w, target)
        decision = [self._plan(costs, target) if self.rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)  # one planner: the others wait idle, not planning too
        plan, queues, tol, predicted = decision[0]
        self.link_queues = list(queues)
        self.detector.adopt(target, tol)
        self.costs = costs
        if plan is None:  # the plan in force is as good as a new one would be: keep it
            self.kept.append((self.iteration, target))
            oh.replan = _ms_since(t)
            return None
        self.plan_in_force = plan
        ev = Replan(self.iteration, links, target, predicted, warmup_counts(plan), [[str(o) for o in r] for r in plan])
        self.replans.append(ev)
        oh.replan = _ms_since(t)
        if self.rank == 0:
            logger.warning("pipemorph: after iteration %d measured link delays %s ms -> re-planned for %s ms: "
                           "warm-up %s, predicted %.1f ms", ev.iteration, _fmt(links), target, ev.warmup, predicted)
            t = time.perf_counter_ns()
            self._write_profile(f"re-plan after iteration {ev.iteration}")
            oh.export = _ms_since(t)
        return plan

    def _plan(self, costs: Costs, target: list[float]):
        """Rank 0's re-plan for ``target``: (plan or None to keep the one in force, queues per link,
        tolerance per link, predicted ms). The plan in force is kept when, under the new delays, it
        is within ``KEEP_WITHIN`` of the lower bound (no search could gain more than that); else the
        deterministic search (bounded by evaluations) runs and delegated links get the queues the
        new plan needs."""
        direct = self._direct(target)
        caps = self._caps_for(target)
        same_links = [d > 0 for d in target] == [d > 0 for d in self.detector.planned_for]
        if same_links:  # same transports and caps: the plan in force still fits them
            current = self.model(target)
            kept = replay(self.plan_in_force, costs, self.N, link_model=current).iteration_ms
            if kept <= (1 + KEEP_WITHIN) * lower_bound_ms(costs, self.N, caps):
                tol = link_tolerances(self.plan_in_force, costs, self.N, resolution_ms=0.1, link_model=current)
                return None, self.link_queues, [t.replay_ms for t in tol], kept
        plan = search(costs, self.N, caps, budget_s=600.0, seed=0, exact=False, max_evals=REPLAN_EVALS,
                      link_model=[DIRECT if d else LATENCY for d in direct]).schedule
        model = self._size_queues(plan, costs, direct)
        tol = [t.replay_ms for t in link_tolerances(plan, costs, self.N, resolution_ms=0.1, link_model=model)]
        return plan, self.link_queues, tol, replay(plan, costs, self.N, link_model=model).iteration_ms

    def _write_profile(self, note: str) -> None:
        """Rank 0: the smoothed measurements to ``profile_out`` (nothing without it or before any measurement)."""
        if self.profile_out and self.export.ready():
            try:
                self.export.write(self.profile_out, note)
            except OSError as e:  # a full disk must not stop training: say so once per write
                logger.warning("pipemorph: cannot write profile_out %s (%s)", self.profile_out, e)

    def overhead_report(self) -> Optional[dict]:
        """The profiler's cost per iteration (``OverheadBook.report``); None before the third iteration."""
        return self.overhead_book.report(len(self.replans), self._stamp_ns)

    def _log_overhead(self) -> None:
        r = self.overhead_report()
        if r is not None:
            logger.warning("pipemorph: %s", OverheadBook.describe(r))

    def close(self) -> None:
        """End of training (idempotent; also at interpreter exit): rank 0 writes ``profile_out`` and logs
        the profiler's overhead."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.rank == 0:  # the process group may be gone already (at exit): nothing here needs it
            self._write_profile(f"end of training, after {self.iteration + 1} iterations")
            self._log_overhead()

    def _direct(self, target: list[float]) -> list[bool]:
        """Per link, whether it runs direct under ``target``: there a slow link holds one message in
        flight and blocks its sender, so plans and tolerances are computed with that model."""
        if self.delegation == "always":
            return [False] * len(target)
        if self.delegation == "auto":
            return [d <= 0 for d in target]
        return [True] * len(target)

    def model(self, target: list[float]) -> list:
        """The simulator's link model (``plan.links``) under ``target``: ``Direct()`` for a direct
        link, ``Delegated(k)`` with its queue count for a delegated one."""
        return [DIRECT if d else Delegated(k) for d, k in zip(self._direct(target), self.link_queues)]

    def _size_queues(self, plan: Schedule, costs: Costs, direct: list[bool]) -> list:
        """Give each delegated link the fewest queues (at least what it has, at most ``max_queues``)
        with which its delegates keep pace with ``plan`` (``plan.queues.queues_needed``), but grow a
        running link only when that gains more than ``GROW_GAIN`` of the iteration: new delegates
        start while training runs (processes, rings, a rendezvous), which on a loaded host costs
        more than a small gain. Returns the link model with those counts."""
        model: list = [DIRECT if d else LATENCY for d in direct]
        for i, d in enumerate(direct):
            if not d:
                model[i] = Delegated(queues_needed(plan, costs, self.N, i, link_model=model, lo=self.link_queues[i],
                                                   hi=max(self.link_queues[i], self.max_queues)))
        for i, d in enumerate(direct):
            if not d and model[i].queues > self.link_queues[i]:
                kept = Delegated(self.link_queues[i])
                now = replay(plan, costs, self.N, link_model=[*model[:i], kept, *model[i + 1:]]).iteration_ms
                grown = replay(plan, costs, self.N, link_model=model).iteration_ms
                if grown > (1 - GROW_GAIN) * now:
                    model[i] = kept
            if not d:
                self.link_queues[i] = model[i].queues
        return model

    def link_modes(self) -> dict[int, str]:
        """Links planned for a delay go delegated under "auto", the others direct; every link is
        delegated under "always" (listed so that its queue count can grow); nothing under "off"."""
        if self.delegation == "always":
            return {i: "delegated" for i in range(self.S - 1)}
        if self.delegation != "auto":
            return {}
        return {i: ("delegated" if d > 0 else "direct") for i, d in enumerate(self.detector.planned_for)}

    def _caps_for(self, target: list[float]) -> Optional[list[int]]:
        """§4.2: stages next to a delegated slow link stage their activations in host memory, so their
        cap is relaxed to N (the pipeline's micro-batch count)."""
        if self.caps is None or self.delegation == "off":
            return self.caps
        caps = list(self.caps)
        for i, d in enumerate(target):
            if d > 0:
                caps[i] = caps[i + 1] = self.N
        return caps

    def _local(self, records, oh: Overhead, device_ms: Optional[dict[str, float]] = None) -> torch.Tensor:
        """[stage, median F, B, W (ms; device times from CUDA events where given), upstream, downstream rank]."""
        t = time.perf_counter_ns()
        dur = {"F": [], "B": [], "W": []}
        if device_ms is not None:
            for op, ms in device_ms.items():
                dur[op[0]].append(ms)
        else:
            for r in records:
                if r.op[:1] in dur and r.op[1:].isdigit():
                    dur[r.op[0]].append((r.end_ns - r.start_ns) / 1e6)
        med = [statistics.median(dur[k]) if dur[k] else -1.0 for k in "FBW"]
        oh.stats = _ms_since(t)
        return torch.tensor([float(self.stage_id), *med, *map(float, self.neighbours)], dtype=torch.float64)

    def _message_times(self, records) -> torch.Tensor:
        """Per message of this iteration, on this rank's clock shifted to each neighbour's where that
        neighbour reads it: blocks of N for [SEND_F end, SEND_B end, RECV_F start, RECV_F end, RECV_B
        start, RECV_B end] (ns, -1 = none), then this rank's clock minus its upstream and downstream
        neighbour's."""
        N = self.N
        out = torch.full((6 * N + 2,), -1.0, dtype=torch.float64)
        base = {"SEND_F": 0, "SEND_B": N, "RECV_F": 2 * N, "RECV_B": 4 * N}
        for r in records:
            head, _, mb = r.op.rpartition("_")
            key = f"{head}_{mb[:1]}"
            if key not in base or not mb[1:].isdigit() or int(mb[1:]) >= N:
                continue
            m = int(mb[1:])
            if key.startswith("SEND"):
                out[base[key] + m] = r.end_ns
            else:
                out[base[key] + 2 * m] = r.start_ns
                out[base[key] + 2 * m + 1] = r.end_ns
        up, down = self.stage_id - 1, self.stage_id + 1
        out[6 * N] = float(self.clock_offsets.get(up, 0))
        out[6 * N + 1] = float(self.clock_offsets.get(down, 0))
        return out

    def _link_delays(self, table: torch.Tensor) -> list[Optional[float]]:
        """Per link, its delay in this iteration in ms (None: no message seen).

        A message's receive end minus its send end (clocks aligned) bounds its transit from above: a
        receive that started after the message came reads late. It is exact when the receive started
        before the send ended: the receiver was waiting all along (as for the first activation of an
        iteration). (A receive that merely took a while is no proof: on a loaded host a process is
        descheduled after its message came.) The link's delay is the median
        of the exact samples of both directions: the delay under a static delay, and a typical one
        (not the luckiest message) when the delay changes within the iteration. Without an exact
        sample it is the smallest bound. (A link slow in one direction only reads as a mix of both:
        the plan's model has one delay per link.) Receiver rows pair with their sender's row by
        global rank (``neighbours``), so each pipeline of a data-parallel job is measured on its
        own; the slowest replica counts.
        """
        N, times0 = self.N, _LOCAL + len(OVERHEAD_FIELDS) + 1
        rows = {int(r): table[r] for r in range(table.shape[0])}
        per_replica: list[dict[int, list]] = [{} for _ in range(self.S - 1)]  # link -> {pipeline: [exact, bounds]}
        fifos = [m.queues if isinstance(m, Delegated) else None for m in self.model(self.detector.planned_for)]  # as this iteration ran
        for r, row in rows.items():
            s = int(row[0].item())
            t = row[times0:].tolist()
            for sender, link, off_col, send_base, recv_base in (
                    (int(row[4].item()), s - 1, 6 * N, 0, 2 * N),
                    (int(row[5].item()), s, 6 * N + 1, N, 4 * N)):
                if sender < 0 or sender not in rows:
                    continue
                sent = rows[sender][times0 + send_base: times0 + send_base + N].tolist()
                offset = t[off_col]  # this (receiving) rank's clock minus the sender's
                exact, bounds = per_replica[link].setdefault(min(r, sender), ([], []))
                add_transits(exact, bounds, sent, t[recv_base: recv_base + 2 * N], offset, fifos[link])
        out: list[Optional[float]] = []
        for v in per_replica:
            est = [link_delay_ms(exact, bounds) for exact, bounds in v.values() if bounds]
            out.append(round(max(est), 3) if est else None)
        return out

    def _raw_per_stage(self, table: torch.Tensor):
        """F, B and W per stage: the max over data-parallel replicas (-1: op not seen)."""
        rows = [table[table[:, 0] == s] for s in range(self.S)]
        return tuple([r[:, col].max().item() for r in rows] for col in (1, 2, 3))

    @staticmethod
    def _rounded(raw: list[float], previous: list[float]) -> list[float]:
        return [_round(ms, old) for ms, old in zip(raw, previous)]


def add_transits(exact: list, bounds: list, sent: list, recv: list, offset: float,
                 fifos: Optional[int] = None) -> None:
    """One direction of a link in one iteration: per message m, ``sent[m]`` is its send's end and
    ``recv[2m]``, ``recv[2m+1]`` its receive's start and end (ns; -1: none), the receiver's clock
    being ``offset`` ns ahead of the sender's. Appends every transit in ms to ``bounds`` and the
    exact ones (the receive started before the send ended) also to ``exact``.

    ``fifos``: the link is delegated with that many FIFOs, whose sender does not wait: a message
    may then queue behind the one before it in its FIFO (``fifos`` messages earlier), which is not
    the link's delay. Its sample counts as exact only when that one had surely arrived (was
    received) before it was sent."""
    for m, s in enumerate(sent):
        start, end = recv[2 * m], recv[2 * m + 1]
        if s < 0 or end < 0:
            continue
        transit = max(0.0, (end - offset - s) / 1e6)
        bounds.append(transit)
        if start - offset > s:  # the receiver was not waiting before the message left
            continue
        j = m - (fifos or 0)  # round robin: the message before it in its FIFO (sends go in micro-batch order)
        if fifos is not None and j >= 0 and sent[j] >= 0 and not 0 <= recv[2 * j + 1] - offset <= s:
            continue  # it may have queued behind that one
        exact.append(transit)


def link_delay_ms(exact: list, bounds: list) -> float:
    """The median exact transit, else the smallest bound."""
    return statistics.median(exact) if exact else min(bounds)


def _ms_since(t_ns: int) -> float:
    return (time.perf_counter_ns() - t_ns) / 1e6


def _round(ms: float, fallback: float) -> float:
    """Op times to 0.5 ms (stable plans); an op never seen keeps its previous estimate."""
    return fallback if ms < 0 else max(0.5, round(ms * 2) / 2)


def _fmt(links) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.1f}" for v in links) + "]"
