"""How much delay each link of a plan absorbs: measured by replaying the plan, next to Eq. 1.

The replayed iteration time under a delay c on one link is T(c) = max over dependency paths of
(length + k·c), k = how often the path crosses the link; so T is convex and piecewise linear, and
{c : T(c) − T(0) ≤ c} is an interval [0, c*]. Secant steps from the right find c*: on a convex
function the secant through two points right of c* meets zero at or right of c*, and each step
lands on a new linear piece, so a few replays give c* exactly (or within ``resolution_ms``).

With pure-latency links and the compiled core (``plan.sim.native``), Newton steps instead, all links
in one call: a replay along the fixed order the first one ran (with pure latency the order in which
ops can run does not depend on the delays) also tells how often its critical path crosses the link
(k, the slope of T there), and that path's line meets T(0) + c at (T(0) − (T(c) − k·c)) / (k − 1),
at or right of c* and on a new piece: c* exactly, in fewer and cheaper replays (64 stages x 1024
micro-batches: 63 links in well under a second instead of minutes).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from ..ir.links import LATENCY, Latency, LinkModel, LinkModels, per_link
from ..ir.ops import Schedule, warmup_counts
from ..ir.profile import Costs
from ..sim import native
from ..sim.simulate import makespan
from .warmup import eq1_tolerance_ms, slackness


@dataclass(frozen=True)
class LinkTolerance:
    link: int
    slackness: int
    eq1_ms: float  # Eq. 1's prediction from the warm-up counts
    replay_ms: float  # largest delay whose replay adds no more than the delay itself
    current_ms: float  # the profile's delay on this link

    @property
    def absorbed(self) -> bool:
        return self.current_ms <= self.replay_ms + 1e-9


def link_tolerances(
    schedule: Schedule, costs: Costs, microbatches: int, *, resolution_ms: float = 0.01, fused: bool = False,
    link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY,
) -> list[LinkTolerance]:
    """Per link: its slackness, Eq. 1's tolerance and the replayed one under ``link_model`` (``plan.ir.links``)."""
    models = per_link(link_model, len(schedule) - 1)
    x = warmup_counts(schedule)
    eq1 = eq1_tolerance_ms(costs, x)
    fast = _native_tolerances(schedule, costs, microbatches, resolution_ms, fused, models)
    out = []
    for i, d in enumerate(slackness(x)):
        tol = fast[i] if fast is not None and fast[i] is not None else \
            _replay_tolerance(schedule, costs, microbatches, i, resolution_ms, fused, models)
        out.append(LinkTolerance(i, d, eq1[i], tol, costs.links[i]))
    return out


def _native_tolerances(schedule, costs, n, res, fused, models: LinkModels):
    """Every link's tolerance from the compiled core (pure latency only), None where it has none."""
    S = len(schedule)
    if S < 2 or native.lib() is None or costs.stages != S:
        return None
    if not all(isinstance(h, Latency) for h in models):
        return None
    enc = native.encode(schedule, n)
    if enc is None:
        return None
    got = native.tolerances(enc, costs, n, fused, list(range(S - 1)), res)
    if got is None:
        return None
    return [None if v is None else (v if v == float("inf") else round(v, 6)) for v in got]


def _replay_tolerance(schedule, costs, n, link, res, fused, models: LinkModels) -> float:
    def makespan_with(c: float) -> float:
        links = list(costs.links)
        links[link] = c
        return makespan(schedule, costs.with_links(links), n, fused_backward=fused, link_model=models)

    t0 = makespan_with(0.0)
    tol = 1e-9 * max(1.0, t0)

    def g(c: float) -> float:  # convex, g(0) = 0; the tolerance is the largest c with g(c) <= 0
        return makespan_with(c) - c - t0

    # Every path crossing the link k >= 2 times has length L_k <= T(0), so c* <= T(0) / (k - 1) <= T(0);
    # beyond that g > 0 unless no path crosses the link twice (then any delay is absorbed).
    b = t0 + max(1.0, res)
    gb = g(b)
    if gb <= tol:
        return float("inf")
    while True:
        a = max(0.0, b - res)
        ga = g(a) if a > 0 else 0.0
        if ga <= tol:  # c* in [a, b]
            return round(a, 6)
        x = b - gb * (b - a) / (gb - ga)  # secant root: c* <= x < a (g is convex and g(a) > 0 = g(0))
        gx = g(x)
        if gx <= tol:
            return round(x, 6)
        b, gb = x, gx
