"""Where a ready-dispatch stage's time goes in one iteration, next to the replay of the same op times.

Per stage, from what the engine records (``OpRecord``s of F, B, W and of each receive, ready
dispatch's choosing time, the inbox's ``settled_ns``) plus the time the inbox's ``post``, ``wait_for``
and ``wait_any`` took (the benchmark times them):

- ``idle``: the iteration (first op start to last op end, over all stages) minus the stage's F, B
  and W; the replay's the same way (``Timeline``). ``busy_over``: the stage's F, B and W over the
  replay's (ops that last longer than their table: a late wake-up, the engine's work inside an op);
  ``over_F``, ``over_B``, ``over_W``: the same by kind.
- ``choosing``, ``settling``, ``posting``: the training thread's own work between ops; ``holding``:
  the patience's waits for the hint's first op's message (``Inbox.wait_for``), ``held_in_vain`` the
  part of them whose message did not come in time (the stage then ran the other op); ``sleeping``: waits
  with no op ready (``Inbox.wait_any``), until a receive's thread has announced its message.
- ``msg_wait``: per op that consumes a message, the time from the stage's previous op's end (the
  iteration's start for the first) until the message was in, or the op started if sooner; the same
  from the replay (``replay_msg_wait``). ``beyond_replay``: per op, how much longer the stage
  waited for its message than in the replay, summed: waiting for a message the replay had in.
- ``msg_in``: idle while the op's message was in (or before an op that needs none): waking up,
  settling, choosing, posting, and the patience's holds.
- ``msg_latency``: per message this stage received, the mean time from the end of the op that
  produced it to its receive's thread having it (the replay: the link's delay, 0 here).

A receive's record ends when its thread has the message (``runtime.inbox``). Link delays are the
replay's ``link_ms`` per link. All in ms. Pure Python: no torch.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ..plan.ir.ops import Kind, recorded_op

FIELDS = ("idle", "replay_idle", "busy_over", "choosing", "settling", "posting", "holding", "held_in_vain", "sleeping",
          "msg_wait",
          "replay_msg_wait", "beyond_replay", "msg_in", "msg_latency", "over_F", "over_B", "over_W")


class StageIteration(NamedTuple):
    """What one rank kept of one iteration (plain data: it crosses ranks as an object)."""
    compute: list  # (kind text, mb, start_ns, end_ns) of F, B, W
    arrivals: dict  # (kind text of the payload, mb) -> ns the receive's thread had it
    choosing_ns: int
    settled_ns: int
    inbox_ns: dict  # ns in the inbox's post, wait_for (patience; wait_for_in_vain: timed out), wait_any


def keep(records, choosing_ns: int, settled_ns: int, inbox_ns: dict) -> StageIteration:
    compute, arrivals = [], {}
    for r in records:
        op = recorded_op(r.op)
        if op is None:
            continue
        if op.kind.is_compute:
            compute.append((op.kind.value, op.mb, r.start_ns, r.end_ns))
        elif op.kind.is_recv:
            arrivals[(op.kind.payload.value, op.mb)] = r.end_ns
    return StageIteration(compute, arrivals, choosing_ns, settled_ns, dict(inbox_ns))


def _source(stage: int, kind: str) -> int:
    """The stage a message of ``kind`` (its text, as kept) reaching ``stage`` comes from."""
    return stage - 1 if Kind(kind) is Kind.F else stage + 1


def _consumes(kind: str, stage: int, stages: int) -> bool:
    k = Kind(kind)
    return (k is Kind.F and stage > 0) or (k is Kind.B and stage < stages - 1)


def _waits(ops: list, arrival, start_ms: float, stage: int, stages: int):
    """``ops``: (kind, mb, start, end) sorted by start; per op, (message wait, idle with it in)."""
    out, prev = {}, start_ms
    for kind, mb, s, e in ops:
        gap = max(0.0, s - prev)
        if _consumes(kind, stage, stages):
            a = arrival(kind, mb)
            wait = max(0.0, min(s, a) - prev)
            out[(kind, mb)] = (wait, gap - wait)
        else:
            out[(kind, mb)] = (0.0, gap)
        prev = max(prev, e)
    return out


def account(per_stage: Sequence[StageIteration], timeline, link_ms: Sequence[float]) -> list[dict]:
    """One iteration: per stage, the fields of ``FIELDS`` in ms (``timeline``: the replay's)."""
    S = len(per_stage)
    t0 = min(c[2] for st in per_stage for c in st.compute)
    t1 = max(c[3] for st in per_stage for c in st.compute)
    span = (t1 - t0) / 1e6
    rep: list[list] = [[] for _ in range(S)]
    ends: dict = {}
    for slot in timeline.slots:
        k = slot.op.kind
        if k.is_compute:
            rep[slot.stage].append((k.value, slot.op.mb, slot.start, slot.end))
            ends[(slot.stage, k.value, slot.op.mb)] = slot.end
    rep_start = min(s[2] for row in rep for s in row)

    def replay_arrival(s):
        def at(kind, mb):
            src = _source(s, kind)
            return ends[(src, kind, mb)] + link_ms[min(s, src)]
        return at

    made = {(s, k, m): e for s, st in enumerate(per_stage) for k, m, _, e in st.compute}
    out = []
    for s, st in enumerate(per_stage):
        ops = sorted(((k, m, (a - t0) / 1e6, (b - t0) / 1e6) for k, m, a, b in st.compute), key=lambda o: o[2])
        arr = {key: (ns - t0) / 1e6 for key, ns in st.arrivals.items()}
        mine = _waits(ops, lambda k, m: arr.get((k, m), float("inf")), 0.0, s, S)
        row = sorted(rep[s], key=lambda o: o[2])
        theirs = _waits(row, replay_arrival(s), rep_start, s, S)
        dur = {(k, m): e - b for k, m, b, e in row}
        over = {k: sum(e - b - dur[(kk, m)] for kk, m, b, e in ops if kk == k) for k in "FBW"}
        busy = sum(e - b for _, _, b, e in ops)
        lat = [(ns - made[(_source(s, k), k, m)]) / 1e6 for (k, m), ns in st.arrivals.items()]
        rep_busy = sum(e - b for _, _, b, e in row)
        out.append({
            "idle": span - busy, "replay_idle": timeline.iteration_ms - rep_busy, "busy_over": busy - rep_busy,
            "choosing": st.choosing_ns / 1e6, "settling": st.settled_ns / 1e6,
            "posting": st.inbox_ns.get("post", 0) / 1e6, "holding": st.inbox_ns.get("wait_for", 0) / 1e6,
            "held_in_vain": st.inbox_ns.get("wait_for_in_vain", 0) / 1e6, "sleeping": st.inbox_ns.get("wait_any", 0) / 1e6,
            "msg_wait": sum(w for w, _ in mine.values()),
            "replay_msg_wait": sum(w for w, _ in theirs.values()),
            "beyond_replay": sum(max(0.0, w - theirs.get(op, (0.0, 0.0))[0]) for op, (w, _) in mine.items()),
            "msg_in": sum(i for _, i in mine.values()), "msg_latency": sum(lat) / len(lat) if lat else 0.0,
            **{f"over_{k}": v for k, v in over.items()}})
    return out


def measured_op_times(per_stage: Sequence[StageIteration]):
    """``(stage, kind, mb) -> ms`` each op lasted in this iteration, for a replay of the ops as they ran."""
    ms = {(s, k, m): (e - b) / 1e6 for s, st in enumerate(per_stage) for k, m, b, e in st.compute}

    def at(stage, kind, mb):
        return ms[(stage, getattr(kind, "value", kind), mb)]
    return at


def link_latency(per_stage: Sequence[StageIteration]) -> list[float]:
    """Per link, the mean ms from the end of the op that produced a message to its receiver having
    it, over both directions (0 for a link that carried none)."""
    made = {(s, k, m): e for s, st in enumerate(per_stage) for k, m, _, e in st.compute}
    sums = [[0.0, 0] for _ in range(len(per_stage) - 1)]
    for s, st in enumerate(per_stage):
        for (k, m), ns in st.arrivals.items():
            src = _source(s, k)
            acc = sums[min(s, src)]
            acc[0] += (ns - made[(src, k, m)]) / 1e6
            acc[1] += 1
    return [total / n if n else 0.0 for total, n in sums]


def mean(rows: Sequence[list[dict]]) -> list[dict]:
    """Per stage, the mean of each field over iterations (``rows``: one ``account`` per iteration)."""
    S = len(rows[0])
    return [{f: sum(r[s][f] for r in rows) / len(rows) for f in FIELDS} for s in range(S)]

