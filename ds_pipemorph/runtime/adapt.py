"""The control loop inside the engine (PipeMorph §6): gather every rank's measurements, let the
policy decide, hand the engine the ``Decision``.

At each exchange each rank contributes what it measured itself in the iteration that just ended:
the median F, B and W times of its stage and, per message, when its sends ended and its receives
started and ended (both from its op records, so nothing extra travels and a slow or delegated link
is measured as training uses it; ``control.estimate``). The boundary's one all-gather
(``runtime.boundary``, beside the other loops' rows) gives every rank every row, so every rank
feeds its ``control.policy.ControlPolicy`` the identical input and gets the identical answer from
``observe``. While the loop is ``quiet`` (the detector counts no slow or recovered link, no search
runs, nothing was decided) the boundary lets exchanges grow apart, up to ``max_exchange_gap``
iterations (``control.exchange``); a slow link is then seen at the next exchange, and from the
first slow observation on every iteration exchanges again, so the detector's iterations in a row
are consecutive iterations: a re-plan comes at most ``max_exchange_gap - 1`` iterations later than
with an exchange every iteration. When a decision is due, rank 0 alone computes it (``propose``: a
search bounded by evaluations) and broadcasts it: the other ranks wait idle instead of planning the
same thing on a shared host. Every rank adopts it and the engine applies it from the next
iteration. Nothing here reads the injection settings.

A re-plan runs off the critical path (``replan="background"``, the default): the decision at the
boundary is the policy's first reaction (``ControlPolicy.react``: keep the plan, or Alg. 2's closed-form
warm-up, milliseconds), and rank 0 hands the search (``ControlPolicy.refine``) to a worker process
(``control.background``). Training goes on with the plan in force; at each exchange (every
iteration while a search runs) rank 0 says in its all-gathered row whether the search has landed,
so every rank learns it in the same iteration, receives the refined decision by broadcast and
switches at the same boundary. While a search runs the detector waits (measurements are still
kept). ``replan="inline"`` runs the whole search at the boundary while every rank waits
(``ControlPolicy.propose``).

Its own cost is measured as it runs (``overhead.Overhead``, one per exchange and rank: wall time
in each part of this code, plus the per-op timestamps of every iteration up to the next exchange at
a cost calibrated at start-up) and shipped with the next exchange's all-gather, with the wall time
and iterations it spans, so every rank can report the cost per iteration on the critical path
(``overhead_report``; rank 0 logs it every ``LOG_EVERY`` iterations and in ``close``). With
``profile_out`` rank 0 writes the smoothed measurements as a profile file (``profile_export``) at
every re-plan and in ``close``.
"""
from __future__ import annotations

import atexit
import logging
import statistics
import time
from dataclasses import astuple, dataclass
from typing import Collection, Optional

import torch
import torch.distributed as dist

from ..control.background import BackgroundPlanner
from ..control.detector import DetectorConfig
from ..control.estimate import Neighbours, RankTimes, link_delays, message_times
from ..control.modes import DelegationMode, ReplanMode
from ..control.policy import REPLAN_EVALS, ControlPolicy, Decision, QueueSettings
from ..plan.ir.links import DIRECT, Direct, LinkModel
from ..plan.ir.memory import MemoryBudget
from ..plan.ir.ops import KINDS, Kind, Schedule, recorded_op, warmup_counts
from ..plan.ir.profile import Costs
from .clocks import estimate_clock_offsets
from .overhead import OVERHEAD_FIELDS, Overhead, OverheadBook, stamp_cost_ns
from .plans import DEFAULT_OP_MS
from .profile_export import ProfileExport
from .transport.protocol import directions_on

logger = logging.getLogger(__name__)

LOG_EVERY = 100  # rank 0 logs the profiler's overhead every this many iterations (and in close())
_PREWARMED = False  # this process started the delegates' fork server ahead of a switch (there is one per process)
_LOCAL = 6  # columns of the all-gathered row before the overhead: stage, F, B, W, upstream rank, downstream rank
_NONE = -1.0  # a neighbour column's value where the stage has no neighbour on that side
_PERIOD = _LOCAL + len(OVERHEAD_FIELDS)  # after the shipped span's overhead: its wall time (ms) ...
_ITERATIONS = _PERIOD + 1  # ... and its iterations (-1: no span ended at this exchange)
_FLAG = _ITERATIONS + 1  # rank 0's "the search landed"
_TIMES = _FLAG + 1  # then the message times


@dataclass
class Replan:
    iteration: int  # decided after this iteration (0-based); in force from the next one
    measured_ms: list[Optional[float]]
    target_ms: list[float]
    predicted_ms: float
    warmup: list[int]
    plan: list[list[str]]
    kind: str = "search"  # "search" (inline), "closed-form" (first reaction) or "refined" (the search landed)
    search_s: Optional[float] = None  # for "refined": seconds the search took beside training
    costs: Optional[dict] = None  # what the plan was made for: per-stage "f", "b", "w" and "links" (ms)


class Adapter:
    def __init__(self, stages: int, microbatches: int, stage_id: int, plan: Schedule, costs: Costs,
                 caps: Optional[list[int]], every: int, clock_offsets: dict[int, int],
                 delegation: DelegationMode = "off", detector: DetectorConfig = DetectorConfig(),
                 profile_out: Optional[str] = None, neighbours: Neighbours = Neighbours(None, None),
                 queues: QueueSettings = QueueSettings(2, 2), replan: ReplanMode = "background",
                 search_evals: int = REPLAN_EVALS,
                 direct: LinkModel = DIRECT, units: Optional[list[float]] = None, w_share: float = 1.0,
                 budget: Optional[MemoryBudget] = None):
        """``caps`` and ``units``: the memory limits; or ``budget``, the engine's ``MemoryBudget``
        itself, which every plan (the first reaction, the search beside training) reads when it is made."""
        self.S, self.N, self.stage_id = stages, microbatches, stage_id
        self.clock_offsets = clock_offsets
        self.neighbours = neighbours  # global ranks of stage s-1 and s+1 in this pipeline
        budget = budget if budget is not None else MemoryBudget(caps, units)
        self.policy = ControlPolicy(plan, costs, microbatches, None, every, delegation, detector, queues, search_evals,
                                    direct, None, w_share, budget=budget)
        self.background = replan == "background"
        self._pending: Optional[Costs] = None  # every rank: the costs a search beside training plans for
        self._landed: Optional[tuple] = None  # rank 0: the search's answer, announced in this boundary's row
        self.iteration = -1
        self.replans: list[Replan] = []
        self.kept: list[tuple[int, list[float]]] = []  # (iteration, target) where the plan in force was kept
        self.measured: list[list[Optional[float]]] = []  # per exchange, per link
        self.overheads: list[Overhead] = []  # this rank's, per exchange (its span: see ``row``)
        self.overhead_book = OverheadBook()  # every rank's, one exchange behind
        self._stamp_ns = stamp_cost_ns()
        self._last_enter: Optional[int] = None  # when the last exchange's row began (perf_counter_ns)
        # The span since the last exchange began: that exchange's own work, then the stamps of the
        # iterations up to the next one (``span_iterations`` of them), shipped in the next one's row.
        self._span: Optional[Overhead] = None
        self._span_iterations = 0
        self._acted = False  # the policy took a decision at this exchange (a new plan, or the plan kept)
        self._prewarm_failed = False  # said once; a switch to the delegates still tries (and fails) on both ends
        self._logged = 0  # overhead lines rank 0 logged (one per LOG_EVERY iterations)
        self.profile_out = profile_out
        self.rank = dist.get_rank()
        self._planner = BackgroundPlanner() if self.background and self.rank == 0 else None
        self.export = ProfileExport(stages, microbatches, budget.caps)
        self._closed = False
        atexit.register(self.close)  # the profile and the overhead line also when nobody calls close()

    @classmethod
    def for_engine(cls, engine, budget: MemoryBudget) -> "Adapter":
        """The engine's control loop, built as the other loops are, from the engine and its memory
        budget: the plan the engine was given, uniform costs until measured, its clocks' offsets,
        its neighbours' ranks and its ``pipemorph`` settings (a collective: every rank builds it)."""
        cfg = engine.pipemorph
        S, s = engine.num_stages, engine.stage_id
        ranks = [engine.grid.stage_to_global(k) for k in range(S)]
        return cls(S, engine.micro_batches, s, engine.first_plan, Costs.uniform(S, DEFAULT_OP_MS), None,
                   cfg.adapt.every_iterations, estimate_clock_offsets(engine.grid, s, S),
                   delegation=cfg.delegation.mode, profile_out=cfg.profile_out,
                   neighbours=Neighbours(ranks[s - 1] if s > 0 else None, ranks[s + 1] if s < S - 1 else None),
                   queues=QueueSettings(cfg.delegation.queues, cfg.delegation.queue_cap),
                   replan=cfg.adapt.replan, search_evals=cfg.adapt.search_evals,
                   direct=engine._direct_link_model(), w_share=engine.w_share, budget=budget)

    @property
    def width(self) -> int:
        """Floats of this loop's row: stage, F, B, W, neighbours, shipped span (overhead, period,
        iterations), flag, times."""
        return _TIMES + 6 * self.N + 2

    def row(self, engine, records) -> list[float]:
        """This rank's row at the exchange that starts now (``boundary.Boundary`` all-gathers it): this
        iteration's measurements and the overhead of the span the last exchange began, which ends
        here (its wall time and iterations give the cost per iteration, ``OverheadBook``)."""
        enter = time.perf_counter_ns()
        self.iteration += 1
        shipped = [-1.0] * (len(OVERHEAD_FIELDS) + 2)  # the first exchange: no span ends here
        if self._span is not None:
            self._span.stamps += len(records) * self._stamp_ns / 1e6
            shipped = [*astuple(self._span), (enter - self._last_enter) / 1e6, self._span_iterations + 1.0]
        self._last_enter, self._span_iterations, self._acted = enter, 0, False
        self._span = oh = Overhead()
        mine = self._local(records, oh, engine.recorder.device_ms(), getattr(engine, "whole_ran", ()))
        if self._pending is not None and self._planner is not None:
            self._landed = self._planner.poll()
        landed = float(self._landed is not None)
        t = time.perf_counter_ns()
        times = message_times(records, self.N, self.stage_id, self.clock_offsets)
        oh.links = _ms_since(t)
        return [*mine, *shipped, landed, *times]

    def skip(self, engine, records) -> None:
        """An iteration without an exchange: counted, and its op stamps charged to the span."""
        self.iteration += 1
        self._span_iterations += 1
        self._span.stamps += len(records) * self._stamp_ns / 1e6

    def quiet(self) -> bool:
        """Nothing on its way to a decision: the detector has run and counts no slow or recovered
        link, no search runs beside training, and no decision was taken in at this exchange."""
        return not self._acted and self._pending is None and self.policy.settled

    def due_by(self) -> Optional[int]:
        """The detector's next run when it runs every k > 1 iterations (``ControlPolicy.next_run``)."""
        return self.policy.next_run

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float) -> Optional[Decision]:
        """Every rank, with every rank's row (rows: [stage, f, b, w, up rank, down rank, overhead...,
        period, iterations, flag, times...]): the same ``Decision`` on every rank when it brings a
        new plan, else None (nothing for the engine to change)."""
        oh, enter = self._span, self._last_enter
        oh.sync, oh.exchange = sync_ms, exchange_ms
        try:
            if table[0, _ITERATIONS] > 0:  # a span ended at this exchange (not at the first one)
                self.overhead_book.add(table[:, _LOCAL:_FLAG])
            return self._decide(table, oh)
        finally:
            t = time.perf_counter_ns()
            if self._prewarm(engine):
                oh.prewarm = _ms_since(t)
            oh.other = max(0.0, _ms_since(enter) - (oh.counted() - oh.stamps) - oh.sync)
            self.overheads.append(oh)
            if self.rank == 0 and self.iteration >= LOG_EVERY * (self._logged + 1):
                self._logged = self.iteration // LOG_EVERY
                self._log_overhead()

    def _decide(self, table: torch.Tensor, oh: Overhead) -> Optional[Decision]:
        t = time.perf_counter_ns()
        f, b, w = self._raw_per_stage(table)
        oh.stats += _ms_since(t)
        t = time.perf_counter_ns()
        links = self._link_delays(table)
        oh.links += _ms_since(t)
        t = time.perf_counter_ns()
        self.measured.append(links)
        if self.iteration > 0:  # the first iteration exchanges layouts and warms up: not representative
            self.export.add(f, b, w, links)
        oh.stats += _ms_since(t)
        if self._pending is not None:  # a search runs beside training: the detector waits for it
            if table[0, _FLAG] <= 0:
                return None
            t = time.perf_counter_ns()
            return self._adopt(self._search_landed(), links, oh, t, "refined")
        t = time.perf_counter_ns()
        costs = self.policy.observe(self.iteration, f, b, w, links)
        oh.detect = _ms_since(t)
        if costs is None:
            return None
        t = time.perf_counter_ns()
        first = self.policy.react if self.background else self.policy.propose
        proposal = [_on_rank0(self.rank, lambda: (first(costs), None))]
        dist.broadcast_object_list(proposal, src=0)  # one planner: the others wait idle, not planning too
        reaction = _raise_failed(proposal[0])
        decision = self._adopt(reaction, links, oh, t, "closed-form" if self.background else "search")
        if self.background and reaction[0].refine:  # a new plan or a kept one: the search may do better
            self._pending = reaction[0].costs
            if self._planner is not None:
                self._planner.submit(self.policy, reaction[0].costs)
        return decision

    def _prewarm(self, engine) -> bool:
        """Under delegation "auto" (where a slow link may move to the delegates), at the first slow
        observation of a link this rank is an end of: start what its delegates come from
        (``LinkControl.prewarm``; a fork server importing torch takes seconds), so that a switch a
        few iterations later finds it ready. Until then no process of the delegates runs. True for the
        call that started it, whose time the overhead report counts apart (a once-off cost)."""
        if self.policy.delegation != "auto" or not self.policy.may_delegate:
            return False  # off; always (started with the engine); or direct sends that do not block
        if self._prewarm_failed or not any(directions_on(self.stage_id, link) for link in self.policy.detector.rising
                                           if isinstance(self.policy.direct_models[link], Direct)):
            return False  # no rising link here that "auto" would move (its direct sends block)
        try:
            engine.transport.prewarm()
        except Exception as e:  # noqa: BLE001  (only a head start, on this rank only: raising would leave the
            # other ranks waiting in the next exchange)
            self._prewarm_failed = True
            logger.warning("pipemorph: rank %d cannot start the delegates' fork server ahead of a switch (%s); "
                           "a link switched to the delegates starts it then, or fails there on both ends",
                           self.rank, e)
            return False
        global _PREWARMED
        first, _PREWARMED = not _PREWARMED, True
        return first  # the call that started it (later ones, of any engine of this process, find it running)

    def _search_landed(self) -> tuple[Decision, float]:
        """Every rank: the landed search's decision and its seconds, broadcast from rank 0. A failed
        worker is said once in the log and the search runs here instead (the others wait for it)."""
        answer: list = [None]
        if self.rank == 0:
            status, *rest = self._landed
            if status == "ok":
                answer = [tuple(rest)]
            else:
                logger.warning("pipemorph: %s; searching on the training thread instead", rest[0])
                t = time.perf_counter()
                answer = [_on_rank0(0, lambda: (self.policy.refine(self._pending), time.perf_counter() - t))]
        dist.broadcast_object_list(answer, src=0)
        self._pending = self._landed = None
        return _raise_failed(answer[0])

    def _adopt(self, proposal: tuple[Decision, Optional[float]], links, oh: Overhead, t: int,
               kind: str) -> Optional[Decision]:
        """Every rank: take the broadcast decision in; the decision when it brings a plan, else None."""
        decision, search_s = proposal
        self.policy.adopt(decision)
        self._acted = True
        if decision.plan is None:  # the plan in force is as good as a new one would be: keep it
            self.kept.append((self.iteration, decision.target_ms))
            oh.replan = _ms_since(t)
            return None
        plan = decision.plan
        ev = Replan(self.iteration, links, decision.target_ms, decision.predicted_ms, warmup_counts(plan),
                    [[str(o) for o in r] for r in plan], kind, search_s, vars(decision.costs).copy())
        self.replans.append(ev)
        oh.replan = _ms_since(t)
        if self.rank == 0:
            beside = f" (searched {search_s * 1e3:.0f} ms beside training)" if search_s is not None else ""
            logger.warning("pipemorph: after iteration %d measured link delays %s ms -> %s%s; planned for %s ms: "
                           "warm-up %s, predicted %.1f ms", ev.iteration, _fmt(links), decision.reason, beside,
                           ev.target_ms, ev.warmup, ev.predicted_ms)
            t = time.perf_counter_ns()
            self._write_profile(f"re-plan after iteration {ev.iteration}")
            oh.export = _ms_since(t)
        return decision

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
        if self._planner is not None:
            self._planner.close()
        if self.rank == 0:  # the process group may be gone already (at exit): nothing here needs it
            self._write_profile(f"end of training, after {self.iteration + 1} iterations")
            self._log_overhead()

    def _local(self, records, oh: Overhead, device_ms: Optional[dict[str, float]] = None,
               whole: Collection[int] = ()) -> list[float]:
        """[stage, median F, B, W (ms; device times from CUDA events where given), upstream, downstream rank].
        The B and W of a micro-batch in ``whole`` ran as one pass (``pipemorph.backward``): they measure
        no split, and are left out (a kind with no sample left keeps its last estimate)."""
        t = time.perf_counter_ns()
        dur: dict = {k: [] for k in KINDS}
        timed = device_ms.items() if device_ms is not None else \
            ((r.op, (r.end_ns - r.start_ns) / 1e6) for r in records)
        for text, ms in timed:
            op = recorded_op(text)
            if op is not None and op.kind.is_compute and (op.kind is Kind.F or op.mb not in whole):
                dur[op.kind].append(ms)
        med = [statistics.median(dur[k]) if dur[k] else -1.0 for k in KINDS]
        oh.stats = _ms_since(t)
        n = self.neighbours
        return [float(self.stage_id), *med, _rank_column(n.upstream), _rank_column(n.downstream)]

    def _link_delays(self, table: torch.Tensor) -> list[Optional[float]]:
        """Per link, its delay in this iteration in ms (None: no message seen), ``estimate.link_delays``
        of every rank's row, with the delegate FIFOs each link ran with."""
        rows = {r: RankTimes(int(row[0]), Neighbours(_column_rank(row[4]), _column_rank(row[5])), row[_TIMES:])
                for r, row in enumerate(table.tolist())}
        return link_delays(rows, self.S - 1, self.N, self.policy.fifos())

    def _raw_per_stage(self, table: torch.Tensor):
        """F, B and W per stage: the max over data-parallel replicas (-1: op not seen)."""
        rows = [table[table[:, 0] == s] for s in range(self.S)]
        return tuple([r[:, col].max().item() for r in rows] for col in (1, 2, 3))


def _rank_column(rank: Optional[int]) -> float:
    """A neighbour's global rank as a column of the float row (``_NONE``: no neighbour)."""
    return _NONE if rank is None else float(rank)


def _column_rank(value: float) -> Optional[int]:
    """The neighbour's global rank read back from its column of the row (None: no neighbour)."""
    return None if value < 0 else int(value)


def _ms_since(t_ns: int) -> float:
    return (time.perf_counter_ns() - t_ns) / 1e6


def _fmt(links) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.1f}" for v in links) + "]"


@dataclass(frozen=True)
class _Failed:
    """Rank 0's planner raised: what every rank raises after the broadcast (none is left waiting)."""
    error: str


def _on_rank0(rank: int, plan):
    """``plan()`` on rank 0 (None elsewhere); a failure becomes a ``_Failed`` to broadcast."""
    if rank != 0:
        return None
    try:
        return plan()
    except Exception as e:  # noqa: BLE001 - every other rank waits in the broadcast: tell them, then fail
        return _Failed(f"{type(e).__name__}: {e}")


def _raise_failed(answer):
    if isinstance(answer, _Failed):
        raise RuntimeError(f"pipemorph: rank 0's planner failed while re-planning: {answer.error}")
    return answer
