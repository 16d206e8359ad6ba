"""An independent longest-path computation over a plan's dependency graph, in exact fractions.

No code of ``ds_pipemorph.plan.sim.simulate`` or ``plan.sched.tolerance`` is involved: tests compare those
against it.
"""
from fractions import Fraction


def longest_paths_by_crossings(schedule, costs, link):
    """{k: length of the longest dependency path that crosses ``link`` k times}, in exact fractions.

    Under pure latency an op starts when the previous op of its stage and its upstream producer (F m
    of the stage before, B m of the stage after) are done, plus the link delay for the latter. So the
    iteration time with a delay c on ``link`` is max over k of (L_k + k·c), L_k counting the other
    links' delays and all op times."""
    S = len(schedule)
    dur = lambda s, kind: Fraction(costs.op_time(s, kind)).limit_denominator()  # noqa: E731
    delay = [Fraction(c).limit_denominator() for c in costs.links]
    pos = {(s, op.kind, op.mb): i for s, row in enumerate(schedule) for i, op in enumerate(row)}
    preds = {}
    for s, row in enumerate(schedule):
        for i, op in enumerate(row):
            p = [((s, i - 1), dur(s, row[i - 1].kind), 0)] if i else []
            if op.kind == "F" and s > 0:
                p.append(((s - 1, pos[(s - 1, "F", op.mb)]), dur(s - 1, "F") + delay[s - 1], int(s - 1 == link)))
            if op.kind == "B" and s < S - 1:
                p.append(((s + 1, pos[(s + 1, "B", op.mb)]), dur(s + 1, "B") + delay[s], int(s == link)))
            preds[(s, i)] = p
    memo = {}

    def start(node):  # {k: latest start over paths with k crossings}
        if node not in memo:
            best = {} if preds[node] else {0: Fraction(0)}
            for q, w, k in preds[node]:
                for kk, length in start(q).items():
                    best[kk + k] = max(best.get(kk + k, length + w), length + w)
            memo[node] = best
        return memo[node]

    out = {}
    for s, row in enumerate(schedule):
        for i, op in enumerate(row):
            for k, length in start((s, i)).items():
                end = length + dur(s, op.kind)
                out[k] = max(out.get(k, end), end)
    return out


def exact_tolerance(schedule, costs, link):
    """The largest delay c on ``link`` with T(c) <= T(0) + c: T(c) = max_k (L_k + k·c), so it is
    min over k >= 2 of (T(0) - L_k) / (k - 1), or infinity when no path crosses the link twice."""
    zero = costs.with_links([0.0 if i == link else c for i, c in enumerate(costs.links)])
    paths = longest_paths_by_crossings(schedule, zero, link)
    t0 = max(paths.values())
    return min(((t0 - length) / (k - 1) for k, length in paths.items() if k >= 2), default=float("inf"))
