"""What the runtime profiler and control loop cost, measured as they run.

Each rank fills one ``Overhead`` per span, from the start of one exchange of the control loops
(``runtime.boundary``) to the start of the next: the wall time spent in each part of the adapter's
code at the exchange, plus the per-op timestamps of the op records of every iteration of the span
at a cost calibrated once per process (``stamp_cost_ns``: two clock reads and an append, measured
against a bare call). The adapter ships the span's ``Overhead``, its wall time and its iterations
in the next exchange's row, which it all-gathers anyway, so ``OverheadBook`` gets every rank's
numbers one exchange late, at no extra collective. Exchanges grow apart while nothing changes
(``control.exchange``): one exchange's cost then falls on several iterations, and the cost per
iteration is the spans' costs over the iterations they span.

Which number is the cost: the ranks leave the exchange together (the all-gather), so per span the
rank with the largest total counts; the others wait for it inside the all-gather, which is why
``exchange`` includes the slowest rank's part before it. The barrier before the exchange (``sync``) waits
for the last rank to finish its iteration: that is the iteration's own time (the job's iteration
ends when its last rank does), not the loops', so it is reported but not counted.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import astuple, dataclass, fields
from typing import Optional

import torch

from .oprecords import OpRecorder


@dataclass
class Overhead:
    """Wall time (ms) one rank spent in the profiler and control loop over one span: one exchange and
    the iterations up to the next one."""

    stamps: float = 0.0  # per-op timestamps: the span's records x the calibrated cost of one
    stats: float = 0.0  # op records -> median F, B, W; all ranks' rows -> per stage and link; smoothing
    links: float = 0.0  # link delays from the op records: per-message times out, transits in
    exchange: float = 0.0  # the all-gather
    detect: float = 0.0  # the straggler detector
    replan: float = 0.0  # search, tolerances, plan-hash check (iterations that re-plan only)
    export: float = 0.0  # writing profile_out (rank 0, iterations that re-plan only)
    prewarm: float = 0.0  # starting the delegates' fork server ahead of a switch (once, under delegation "auto")
    other: float = 0.0  # the rest of the boundary's wall time in the adapter (tensors, bookkeeping)
    sync: float = 0.0  # barrier before the exchange: waiting for the last rank to finish (not counted)

    def counted(self) -> float:
        return sum(astuple(self)) - self.sync


OVERHEAD_FIELDS = tuple(f.name for f in fields(Overhead))
_COUNTED = [i for i, k in enumerate(OVERHEAD_FIELDS) if k != "sync"]
_STAMP_NS: Optional[float] = None


def stamp_cost_ns(n: int = 2000) -> float:
    """What ``OpRecorder.run`` adds around one op (without NVTX), in ns; measured once per process, the
    least disturbed of three rounds (the host is shared)."""
    global _STAMP_NS
    if _STAMP_NS is None:
        rec, noop = OpRecorder(False), (lambda: None)
        bare = stamped = float("inf")  # each loop's least disturbed round (a difference of one round can go
        for _ in range(3):            # negative when the bare loop is the one interrupted)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                noop()
            t1 = time.perf_counter_ns()
            for _ in range(n):
                rec.run("F0", noop)
            t2 = time.perf_counter_ns()
            rec.reset()
            bare, stamped = min(bare, t1 - t0), min(stamped, t2 - t1)
        best = max(0.0, (stamped - bare) / n)
        _STAMP_NS = best
    return _STAMP_NS


class OverheadBook:
    """Every rank's ``Overhead`` per span, as all-gathered: one row per rank of ``OVERHEAD_FIELDS``
    followed by the span's wall time in ms and its iterations (the same on every rank)."""

    def __init__(self):
        self.rows: list[torch.Tensor] = []  # row k: span k, from exchange k to exchange k+1

    def add(self, table: torch.Tensor) -> None:
        self.rows.append(table.clone())

    def report(self, replans: int, stamp_ns: float) -> Optional[dict]:
        """Per iteration over the spans from the second one on (the first sets up the exchange): the
        costliest rank's total and parts, summed over spans and divided by their iterations; the
        same without the spans that re-planned or started the delegates' fork server, once-off costs
        (``steady``), and the cost of one re-plan; shares of a
        typical iteration, the median of the spans' wall time per iteration (a mean would count
        one-off stalls such as starting delegate processes after a re-plan). None: too early."""
        rows = self.rows[1:]
        if not rows:
            return None
        n, i_replan, i_prewarm = len(OVERHEAD_FIELDS), OVERHEAD_FIELDS.index("replan"), OVERHEAD_FIELDS.index("prewarm")
        worst = [r[int(r[:, _COUNTED].sum(1).argmax())] for r in rows]
        totals = [float(x[_COUNTED].sum()) for x in worst]
        spans = [float(r[0, n + 1]) for r in rows]
        period = statistics.median(float(r[:, n].max()) / k for r, k in zip(rows, spans))
        steady = [(tot, k) for tot, k, x in zip(totals, spans, worst) if x[i_replan] == 0 and x[i_prewarm] == 0]
        each = [float(x[i_replan]) for x in worst if x[i_replan] > 0]
        iterations = sum(spans)
        mean = sum(totals) / iterations
        steady_mean = sum(t for t, _ in steady) / sum(k for _, k in steady) if steady else None
        return {
            "iterations": round(iterations),
            "exchanges": len(rows),
            "ms_per_iteration": round(mean, 3),
            "pct_of_iteration": round(100.0 * mean / period, 2),
            "steady_ms_per_iteration": None if steady_mean is None else round(steady_mean, 3),
            "steady_pct_of_iteration": None if steady_mean is None else round(100.0 * steady_mean / period, 2),
            "replan_ms_each": round(statistics.fmean(each), 1) if each else None,
            "iteration_ms": round(period, 1),
            "max_ms": round(max(totals), 3),  # the costliest span
            "parts_ms": {k: round(sum(float(x[i]) for x in worst) / iterations, 3)
                         for i, k in enumerate(OVERHEAD_FIELDS)},
            "stamp_ns_per_op": round(stamp_ns, 1),
            "replans": replans,
        }

    @staticmethod
    def describe(r: dict) -> str:
        """One log line for a ``report``."""
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts_ms"].items() if k != "sync")
        steady = "" if r["steady_ms_per_iteration"] is None else (
            f"; without re-plans and the delegates' start {r['steady_ms_per_iteration']:.2f} ms "
            f"({r['steady_pct_of_iteration']:.2f}%)")
        each = "" if r["replan_ms_each"] is None else f", {r['replan_ms_each']:.0f} ms per re-plan"
        return (f"profiler overhead {r['ms_per_iteration']:.2f} ms per iteration ({r['pct_of_iteration']:.2f}% of a "
                f"{r['iteration_ms']:.0f} ms iteration){steady} over {r['iterations']} iterations ({r['exchanges']} "
                f"exchanges) with {r['replans']} re-plans{each} [{parts} ms; waiting for the last rank at the "
                f"boundary, not counted: {r['parts_ms']['sync']:.2f} ms]")
