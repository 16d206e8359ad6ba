"""A measured trace as Chrome/Perfetto trace-event JSON, and back.

Format (also what the engine's ``"timeline"`` option writes):

- one process per rank: ``pid`` = rank, ``process_name`` metadata ``"rank R (stage S)"``;
- tracks (tids): 0 ``compute`` (slices ``F3``/``B3``/``W3``), 1 ``sends`` (``SEND_F3``...),
  2 ``receives`` (``RECV_B3``...), 3 ``iterations`` (``ITER<k>``); ranges that overlap on one
  track go to extra lanes (tid + 4, + 8, ...) so that slices on a tid never partially overlap;
- complete events (``ph: "X"``), ``ts``/``dur`` in µs from the first range of the trace, args
  ``{stage, microbatch, iteration}`` (an open ``ITER`` range: ``args.open = true``);
- a flow arrow per matched message: ``ph: "s"`` at the send's start and ``ph: "f"``, ``bp: "e"``
  at the receive's start, with the same ``id``.

The reader takes ``X`` events only; a process named ``"stage S"`` (the planner's simulated
timelines) counts as rank S of stage S.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

from ..fileio import BadInput, first_line
from .measured import IterMark, MeasuredOp, MeasuredTrace, RankTrace, assign_iterations, message_pairs, parse_range_name

TRACKS = ("compute", "sends", "receives", "iterations")
_TRACK_OF = {"compute": 0, "send": 1, "recv": 2}
_PROCESS = re.compile(r"^rank (\d+) \(stage (\d+)\)$")
_SIM_PROCESS = re.compile(r"^stage (\d+)$")


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def _lanes(items: list[tuple[int, int, object]]) -> dict[int, int]:
    """Greedy lane per item (by index): items in one lane never overlap."""
    order = sorted(range(len(items)), key=lambda i: (items[i][0], -items[i][1]))
    ends: list[int] = []
    lane: dict[int, int] = {}
    for i in order:
        s, e, _ = items[i]
        for j, last in enumerate(ends):
            if last <= s:
                ends[j] = e
                lane[i] = j
                break
        else:
            ends.append(e)
            lane[i] = len(ends) - 1
    return lane


def measured_to_chrome(trace: MeasuredTrace) -> dict:
    starts = [o.start_ns for r in trace.ranks for o in r.ops] + [m.start_ns for r in trace.ranks for m in r.marks.values()]
    t0 = min(starts)
    events: list[dict] = []
    tid_of: dict[tuple[int, MeasuredOp], int] = {}
    for r in trace.ranks:
        events.append({"ph": "M", "pid": r.rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {r.rank} (stage {r.stage})"}})
        events.append({"ph": "M", "pid": r.rank, "tid": 0, "name": "process_sort_index", "args": {"sort_index": r.rank}})
        last_end = max(o.end_ns for o in r.ops)
        tracks: dict[int, list[tuple[int, int, object]]] = defaultdict(list)
        for o in r.ops:
            tracks[_TRACK_OF[o.what]].append((o.start_ns, o.end_ns, o))
        for k, m in sorted(r.marks.items()):
            tracks[3].append((m.start_ns, m.end_ns if m.end_ns is not None else max(last_end, m.start_ns), (k, m)))
        named: set[int] = set()
        for track, items in sorted(tracks.items()):
            lanes = _lanes(items)
            for idx, (s, e, what) in enumerate(items):
                tid = track + 4 * lanes[idx]
                if tid not in named:
                    named.add(tid)
                    label = TRACKS[track] + (f" {lanes[idx] + 1}" if lanes[idx] else "")
                    events.append({"ph": "M", "pid": r.rank, "tid": tid, "name": "thread_name", "args": {"name": label}})
                    events.append({"ph": "M", "pid": r.rank, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
                ev = {"ph": "X", "pid": r.rank, "tid": tid, "ts": _us(s - t0), "dur": _us(e - s)}
                if track == 3:
                    k, m = what
                    ev.update(name=f"ITER{k}", cat="iteration", args={"stage": r.stage, "iteration": k})
                    if m.end_ns is None:
                        ev["args"]["open"] = True
                else:
                    tid_of[(r.rank, what)] = tid
                    ev.update(name=what.name, cat=what.op.kind if what.what == "compute" else what.what,
                              args={"stage": r.stage, "microbatch": what.op.mb, "iteration": what.iteration})
                events.append(ev)
    pairs, _ = message_pairs(trace)
    for n, (link, a, send, b, recv) in enumerate(pairs):
        name = f"{send.op} link {link}"
        events.append({"ph": "s", "id": n, "pid": a.rank, "tid": tid_of[(a.rank, send)], "ts": _us(send.start_ns - t0), "name": name, "cat": "message"})
        events.append({"ph": "f", "bp": "e", "id": n, "pid": b.rank, "tid": tid_of[(b.rank, recv)], "ts": _us(recv.start_ns - t0), "name": name, "cat": "message"})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": trace.source, "format": "pipemorph-measured", "stages": trace.stages,
                      "ranks": len(trace.ranks), "origin_ns": t0, **trace.extra},
    }


def slices_nest_per_track(events: list[dict]) -> bool:
    """True when the X slices on each (pid, tid) are disjoint or fully nested, never partially
    overlapping: what trace viewers need to draw a track (checked by the tests on every writer)."""
    by_track: dict = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        stack: list = []
        for s, e in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= s:
                stack.pop()
            if stack and e > stack[-1]:
                return False
            stack.append(e)
    return True


def chrome_json(trace: MeasuredTrace) -> str:
    return json.dumps(measured_to_chrome(trace)) + "\n"


def read_chrome(path: str | Path) -> MeasuredTrace:
    """A measured trace from trace-event JSON in the format above."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{p}: not valid JSON ({first_line(e)})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise BadInput(f"{p}: not a Chrome trace (expected a 'traceEvents' list of event objects)")
    names: dict[object, tuple[Optional[int], Optional[int]]] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            label = str((e.get("args") or {}).get("name", ""))
            m = _PROCESS.match(label)
            if m:
                names[e.get("pid")] = (int(m.group(1)), int(m.group(2)))
            elif _SIM_PROCESS.match(label):
                s = int(_SIM_PROCESS.match(label).group(1))
                names[e.get("pid")] = (s, s)
    raw: dict[object, list] = defaultdict(list)
    marks: dict[object, dict[int, IterMark]] = defaultdict(dict)
    arg_stage: dict[object, set[int]] = defaultdict(set)
    explicit_iteration = True
    for e in events:
        if e.get("ph") != "X":
            continue
        parsed = parse_range_name(str(e.get("name", "")))
        if parsed is None:
            continue
        try:
            s = round(float(e["ts"]) * 1000)
            d = round(float(e.get("dur", 0)) * 1000)
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{p}: slice '{e.get('name')}' has no numeric ts/dur") from None
        args = e.get("args") or {}
        pid = e.get("pid")
        if parsed.what == "iter":
            marks[pid][parsed.iteration] = IterMark(s, None if args.get("open") else s + d)
            continue
        if isinstance(args.get("stage"), int):
            arg_stage[pid].add(args["stage"])
        if parsed.stage is not None:
            arg_stage[pid].add(parsed.stage)
        it = args.get("iteration")
        if not isinstance(it, int):
            explicit_iteration = False
        raw[pid].append((parsed.what, parsed.op, s, s + d, it))
    if not any(w == "compute" for v in raw.values() for w, *_ in v):
        raise BadInput(f"{p}: a trace without pipemorph compute slices (F<m>, B<m>, W<m>)")
    ranks = []
    for n, pid in enumerate(sorted(raw, key=str)):
        rank, stage = names.get(pid, (None, None))
        stages = arg_stage[pid] | ({stage} if stage is not None else set())
        if len(stages) != 1:
            what = "no stage" if not stages else f"stages {sorted(stages)}"
            raise BadInput(f"{p}: process {pid} has {what} (name it 'rank R (stage S)' or give args.stage)")
        if rank is None:
            rank = pid if isinstance(pid, int) else n
        if explicit_iteration:
            ops = [MeasuredOp(w, op, s, e, it) for w, op, s, e, it in raw[pid]]
        else:
            ops, _ = assign_iterations([(w, op, s, e) for w, op, s, e, _ in raw[pid]], marks[pid])
        if not ops:
            continue  # every slice of this process lies outside its ITER slices
        ops.sort(key=lambda o: (o.start_ns, o.end_ns))
        ranks.append(RankTrace(rank, stages.pop(), None, ops, dict(marks[pid])))
    if not ranks:
        raise BadInput(f"{p}: no compute slice lies inside an ITER slice")
    if len({r.rank for r in ranks}) != len(ranks):
        raise BadInput(f"{p}: two processes claim the same rank")
    ranks.sort(key=lambda r: r.rank)
    present = {r.stage for r in ranks}
    if len(present) != max(present) + 1:
        gap = min(set(range(max(present) + 1)) - present)
        raise BadInput(f"{p}: no process carries stage {gap}, but stage {max(present)} exists")
    return MeasuredTrace(str(p), ranks)
