"""PipeMorph §7.2 dynamic delay traces: generate them, write them, and summarise one for the planner.

Each slow link's extra one-way delay is drawn from N(mean=30, sd=10) ms, clipped at 0, and redrawn
after an interval drawn from U(a, b) ms, independently per link, from t = 0 to the duration. The
paper's three change rates are presets: A = U(50, 100), B = U(100, 200), C = U(200, 400) ms. Links
not in the slow set stay at 0 ms. The output is the trace format of
``ds_pipemorph/inject/delays.py`` (``points: [{t: seconds, links_ms: [...]}]``, one point per
change, each with every link's delay). Same arguments and seed, same trace.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import yaml

from ..fileio import write_atomic

if TYPE_CHECKING:  # the runtime imports torch; this module only reads a trace's points
    from ..inject.delays import DelayTraceFile

RATES = {"A": (50.0, 100.0), "B": (100.0, 200.0), "C": (200.0, 400.0)}


def make_trace(links: int, slow: Sequence[int], duration_s: float, interval_ms: tuple[float, float],
               mean_ms: float = 30.0, sd_ms: float = 10.0, seed: int = 0) -> dict:
    """The trace as a mapping: sorted change points, each with every link's delay in ms."""
    if links < 1:
        raise ValueError(f"a pipeline of {links + 1} stages has no link")
    bad = [i for i in slow if not 0 <= i < links]
    if bad:
        raise ValueError(f"slow link {bad[0]} does not exist: links are 0..{links - 1}")
    a, b = interval_ms
    if not 0 < a <= b:
        raise ValueError(f"interval U({a:g}, {b:g}) ms needs 0 < a <= b")
    if duration_s <= 0 or mean_ms < 0 or sd_ms < 0:
        raise ValueError("duration, mean and sd must be positive (mean and sd may be 0)")
    rng = random.Random(seed)
    changes: dict[float, dict[int, float]] = {0.0: {}}
    for link in sorted(set(slow)):  # each link has its own stream of draws, in link order
        t = 0.0
        while t < duration_s:
            changes.setdefault(round(t, 6), {})[link] = round(max(0.0, rng.gauss(mean_ms, sd_ms)), 3)
            t += rng.uniform(a, b) / 1000.0
    current = [0.0] * links
    points = []
    for t in sorted(changes):
        for link, c in changes[t].items():
            current[link] = c
        points.append({"t": round(t, 4), "links_ms": list(current)})
    return {"points": points}


def trace_text(trace: dict, header: str) -> str:
    """The YAML text of a trace, behind a ``# header`` comment line naming how it was made."""
    return f"# {header}\n" + yaml.safe_dump(trace, sort_keys=False, default_flow_style=None, width=200)


def paper_trace_paths(out_dir: Path) -> list[Path]:
    """Where ``write_paper_traces`` puts the three cases: ``dynamic_A.yaml``, ``dynamic_B.yaml``, ``dynamic_C.yaml``."""
    return [out_dir / f"dynamic_{rate}.yaml" for rate in RATES]


def write_paper_traces(out_dir: Path, stages: int, duration_s: float, seed: int = 0) -> list[Path]:
    """The three §7.2 cases for every link of ``stages`` stages: ``dynamic_A.yaml`` (U(50, 100) ms),
    ``dynamic_B.yaml`` and ``dynamic_C.yaml``, written atomically into ``out_dir``; their paths."""
    paths = []
    for (rate, interval), path in zip(RATES.items(), paper_trace_paths(out_dir)):
        tr = make_trace(stages - 1, range(stages - 1), duration_s, interval, seed=seed)
        write_atomic(path, trace_text(tr, f"pipemorph bench --dynamic: every link N(30, 10) ms, changed every "
                                          f"U({interval[0]:g}, {interval[1]:g}) ms, {duration_s:g} s, seed {seed}"))
        paths.append(path)
    return paths


def mean_delays(trace: DelayTraceFile, until_s: float | None = None) -> list[float]:
    """Per link, the time-weighted mean delay from t = 0 to ``until_s`` (default: the last change;
    a trace of one point is that point's delays). The delay before the first point is the first one's."""
    pts = trace.points
    end = pts[-1].t if until_s is None else until_s
    if end <= 0:
        return list(pts[0].links_ms)
    total = [0.0] * len(pts[0].links_ms)
    for p, nxt in zip(pts, [q.t for q in pts[1:]] + [max(end, pts[-1].t)]):
        lo, hi = max(p.t, 0.0) if p is not pts[0] else 0.0, min(nxt, end)
        if hi > lo:
            total = [s + c * (hi - lo) for s, c in zip(total, p.links_ms)]
    return [round(s / end, 3) for s in total]
