"""How much delay each link of a plan absorbs: measured by replaying the plan, next to Eq. 1.

The replayed iteration time under a delay c on one link is T(c) = max over dependency paths of
(length + k·c), k = how often the path crosses the link; so T is convex and piecewise linear, and
{c : T(c) − T(0) ≤ c} is an interval [0, c*]. Bisection finds c* to ``resolution_ms``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .links import LATENCY
from .profile import Costs
from .simulate import Schedule, makespan, warmup_counts
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
    schedule: Schedule, costs: Costs, microbatches: int, resolution_ms: float = 0.01, fused: bool = False,
    link_model=LATENCY,
) -> list[LinkTolerance]:
    """Per link: its slackness, Eq. 1's tolerance and the replayed one under ``link_model`` (``plan.links``)."""
    x = warmup_counts(schedule)
    eq1 = eq1_tolerance_ms(costs, x)
    out = []
    for i, d in enumerate(slackness(x)):
        out.append(LinkTolerance(i, d, eq1[i], _replay_tolerance(schedule, costs, microbatches, i, resolution_ms, fused, link_model), costs.links[i]))
    return out


def _replay_tolerance(schedule, costs, n, link, res, fused, link_model) -> float:
    def excess(c: float) -> float:
        links = list(costs.links)
        links[link] = c
        return makespan(schedule, costs.with_links(links), n, fused, link_model) - c

    base = excess(0.0)
    ok = lambda c: excess(c) <= base + 1e-9  # noqa: E731
    lo, hi = 0.0, max(1.0, res)
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e7:  # pragma: no cover - a pipeline that never crosses the link twice
            return float("inf")
    while hi - lo > res:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return round(lo, 6)
