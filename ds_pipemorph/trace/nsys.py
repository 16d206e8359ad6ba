"""Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into a ``MeasuredTrace``.

NVTX contract (what ``ds_pipemorph.runtime.oprecords`` emits; domain ``"pipemorph"``)
----------------------------------------------------------------------------------
Each rank (one process) wraps every ``train_batch`` in a range ``ITER<k>`` and every instruction
of it in a nested range named like the op, all push/pop ranges in domain ``pipemorph``::

    ITER1   category "stage2", payload 5      # the 2nd train_batch (k from 0) of global rank 5
      F3    category "stage2", payload 3      # the forward of micro-batch 3 on stage 2
      ...

- ``message``: ``ITER<k>`` (k counts the engine's ``train_batch`` calls from 0), or the op text.
  Compute: ``F<m>``, ``B<m>``, ``W<m>``. Communication: ``SEND_F<m>`` / ``RECV_F<m>`` (activation
  of micro-batch m, stage i -> i+1) and ``SEND_B<m>`` / ``RECV_B<m>`` (its input gradient, stage
  i+1 -> i). A range covers the whole call (for a non-blocking send: issue to completion). Other
  messages (``LOAD3``, ``OptimizerStep``, ...) are the engine's other instructions; ignored here.
- ``category``: ``"stage<S>"``, the pipeline stage of the process, on every range (the ``nvtx``
  package names it once with ``nvtxDomainNameCategoryA``; the ranges carry its id). Runtimes that
  cannot set a category may prefix the message instead: ``"stage2/F3"``.
- ``payload`` (int64): on ``ITER<k>`` the process's global rank; on an op the micro-batch
  (informational: the message is authoritative; a mismatch is counted in a warning).

How processes become ranks: the stage comes from the category (or prefix), the rank from the
``ITER`` payload, and a ``RankTrace``'s ``rank`` is that global rank. With data parallelism the
replicas of a stage are taken in rank order and the k-th replica of stage i exchanges messages with
the k-th of stage i+1 (DeepSpeed numbers rank = stage * dp + replica). Without rank payloads the
processes are numbered in (stage, pid) order, with a warning when a stage has several processes
(their pairing across stages is then a guess); without any stage information, processes are
mapped to stages 0, 1, ... in pid order and a warning says so. Without ``ITER`` ranges the whole
trace is one iteration.

Schema facts relied on (Nsight Systems SQLite export)
-----------------------------------------------------
- ``NVTX_EVENTS(start, end, eventType, rangeId, category, color, text, globalTid, endGlobalTid,
  textId, domainId, uint64Value, int64Value, doubleValue, uint32Value, int32Value, ...)``; times in
  ns on one session clock for all processes; ``end`` is NULL for a range that never closed.
- ``eventType`` (ENUM_NSYS_EVENT_TYPE): 33 NvtxCategory (names a category: ``category`` = id,
  ``text`` = name, per ``domainId``), 34 NvtxMark, 59 NvtxPushPopRange, 60 NvtxStartEndRange,
  75 NvtxDomainCreate (``domainId`` and the domain name in ``text``).
- A range's message is inline in ``text`` or, for a registered string (the ``nvtx`` Python
  package registers every message), in ``StringIds(id, value)`` via ``textId``.
- ``globalTid`` packs hardware id, VM id, pid and tid (see ``pid_of``).
- Optional: ``TARGET_INFO_SESSION_START_TIME(utcEpochNs, ...)`` (wall-clock origin of ``start``).
"""
from __future__ import annotations

import re
import sqlite3
from collections import defaultdict
from pathlib import Path
from ..fileio import BadInput, first_line
from .measured import IterMark, MeasuredTrace, RankTrace, assign_iterations, parse_range_name

DOMAIN = "pipemorph"
SQLITE_MAGIC = b"SQLite format 3\x00"

NVTX_CATEGORY = 33
NVTX_MARK = 34
NVTX_PUSH_POP_RANGE = 59
NVTX_START_END_RANGE = 60
NVTX_DOMAIN_CREATE = 75

_STAGE_CATEGORY = re.compile(r"^stage(\d+)$")
_PAYLOAD_COLUMNS = ("int64Value", "uint64Value", "int32Value", "uint32Value")


def pid_of(global_tid: int) -> int:
    """The process id inside an nsys ``globalTid``.

    Nsight Systems serialises a thread as ``(hw_id << 56) | (vm_id << 48) | (pid << 24) | tid``;
    its SQLite export docs decode the pid as ``globalTid / 0x1000000 % 0x1000000`` and the tid as
    ``globalTid % 0x1000000``, i.e. the pid is bits 24..47.
    """
    return (int(global_tid) >> 24) & 0xFFFFFF


def tid_of(global_tid: int) -> int:
    """The thread id inside an nsys ``globalTid`` (bits 0..23, see ``pid_of``)."""
    return int(global_tid) & 0xFFFFFF


def is_sqlite(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(16) == SQLITE_MAGIC


def read_nsys(path: str | Path) -> MeasuredTrace:
    """Per-rank measured timelines from the ``pipemorph`` NVTX ranges of an nsys SQLite export."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    if not is_sqlite(p):
        raise BadInput(f"{p}: not an SQLite file (expected the output of `nsys export --type sqlite`)")
    try:
        con = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise BadInput(f"{p}: cannot open it as SQLite ({e})") from None
    try:
        return _read(con, p)
    except sqlite3.DatabaseError as e:
        raise BadInput(f"{p}: unreadable SQLite export ({first_line(e)})") from None
    finally:
        con.close()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}


def _read(con: sqlite3.Connection, p: Path) -> MeasuredTrace:
    cols = _columns(con, "NVTX_EVENTS")
    if not cols:
        raise BadInput(f"{p}: no NVTX_EVENTS table (profile with `nsys profile --trace=nvtx` and export with `nsys export --type sqlite`)")
    for need in ("start", "end", "eventType", "globalTid", "domainId"):
        if need not in cols:
            raise BadInput(f"{p}: NVTX_EVENTS has no '{need}' column, so it is not an Nsight Systems export this tool can read")
    has_strings = {"id", "value"} <= _columns(con, "StringIds") and "textId" in cols
    text = "COALESCE(e.text, s.value)" if has_strings else "e.text"
    if "text" not in cols:
        text = "s.value" if has_strings else "NULL"
    join = "LEFT JOIN StringIds s ON s.id = e.textId" if has_strings else ""
    category = "e.category" if "category" in cols else "NULL"
    payload_cols = [f"e.{c}" for c in _PAYLOAD_COLUMNS if c in cols]
    payload = f"COALESCE({', '.join(payload_cols)})" if len(payload_cols) > 1 else (payload_cols[0] if payload_cols else "NULL")

    # Domains: (pid, domainId) and domainId alone (ids may or may not be unique across processes).
    dom_pid: set[tuple[int, int]] = set()
    other_pid: set[tuple[int, int]] = set()
    for gtid, did, name in con.execute(
        f"SELECT e.globalTid, e.domainId, {text} FROM NVTX_EVENTS e {join} WHERE e.eventType = ?", (NVTX_DOMAIN_CREATE,)
    ):
        if did is None:
            continue
        (dom_pid if name == DOMAIN else other_pid).add((pid_of(gtid or 0), did))
    dom_ids = {d for _, d in dom_pid}
    if not dom_ids:
        raise BadInput(f"{p}: no NVTX ranges in domain '{DOMAIN}' (no domain named '{DOMAIN}' was created)")

    # Category names per (pid, domain, id), with a fallback per (domain, id).
    cat_names: dict[tuple, str] = {}
    if category != "NULL":
        for gtid, did, cid, name in con.execute(
            f"SELECT e.globalTid, e.domainId, e.category, {text} FROM NVTX_EVENTS e {join} WHERE e.eventType = ?",
            (NVTX_CATEGORY,),
        ):
            if did in dom_ids and cid is not None and name:
                cat_names[(pid_of(gtid or 0), did, cid)] = name
                cat_names.setdefault((None, did, cid), name)

    marks = ",".join("?" * len(dom_ids))
    rows = con.execute(
        f"SELECT e.start, e.end, {text}, e.globalTid, e.domainId, {category}, {payload} FROM NVTX_EVENTS e {join} "
        f"WHERE e.eventType IN (?, ?) AND e.domainId IN ({marks}) ORDER BY e.start",
        (NVTX_PUSH_POP_RANGE, NVTX_START_END_RANGE, *sorted(dom_ids)),
    ).fetchall()
    session = None
    if _columns(con, "TARGET_INFO_SESSION_START_TIME") >= {"utcEpochNs"}:
        r = con.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
        session = r[0] if r else None
    return _build(p, rows, dom_pid, other_pid, cat_names, session)


def _build(p: Path, rows, dom_pid, other_pid, cat_names, session) -> MeasuredTrace:
    warnings: list[str] = []
    ops: dict[int, list] = defaultdict(list)  # pid -> (what, op, start, end)
    marks: dict[int, dict[int, IterMark]] = defaultdict(dict)
    stages: dict[int, set[int]] = defaultdict(set)
    iter_ranks: dict[int, set[int]] = defaultdict(set)  # pid -> rank payloads of its ITER ranges
    unclosed = payload_mismatch = 0
    for start, end, name, gtid, did, cid, payload in rows:
        pid = pid_of(gtid or 0)
        if (pid, did) not in dom_pid and (pid, did) in other_pid:
            continue  # this process gave the same id to another domain
        parsed = parse_range_name(name)
        if parsed is None:
            continue
        cat = cat_names.get((pid, did, cid), cat_names.get((None, did, cid))) if cid is not None else None
        m = _STAGE_CATEGORY.match(cat or "")
        stage = int(m.group(1)) if m else parsed.stage
        if parsed.what == "iter":
            if parsed.iteration in marks[pid]:
                warnings.append(f"pid {pid} has two ITER{parsed.iteration} ranges; the first one is used")
            else:
                marks[pid][parsed.iteration] = IterMark(int(start), None if end is None else int(end))
            if stage is not None:
                stages[pid].add(stage)
            if payload is not None:
                iter_ranks[pid].add(int(payload))
            continue
        if end is None or end < start:
            unclosed += 1
            continue
        if m:
            stages[pid].add(int(m.group(1)))
        if parsed.stage is not None:
            stages[pid].add(parsed.stage)
        if payload is not None and int(payload) != parsed.op.mb:
            payload_mismatch += 1
        ops[pid].append((parsed.what, parsed.op, int(start), int(end)))
    if not ops:
        raise BadInput(f"{p}: no '{DOMAIN}' op ranges (F<m>, B<m>, W<m>, SEND_*, RECV_*) in NVTX_EVENTS")
    if not any(w == "compute" for v in ops.values() for w, *_ in v):
        raise BadInput(f"{p}: no '{DOMAIN}' compute ranges (F<m>, B<m>, W<m>), only communication")
    pids = sorted(ops)
    for pid in pids:
        if len(stages[pid]) > 1:
            raise BadInput(f"{p}: pid {pid} carries ranges of stages {sorted(stages[pid])}; one process is one stage")
    with_stage = [pid for pid in pids if stages[pid]]
    if with_stage and len(with_stage) != len(pids):
        missing = next(pid for pid in pids if not stages[pid])
        raise BadInput(f"{p}: pid {missing} has no stage category while other processes do (use category 'stage<S>' on every range)")
    if not with_stage:
        warnings.append(f"no stage category on the '{DOMAIN}' ranges: mapped {len(pids)} processes to stages 0..{len(pids) - 1} in pid order")
    if unclosed:
        warnings.append(f"{unclosed} op ranges never closed (or end before they start) and were left out")
    if payload_mismatch:
        warnings.append(f"{payload_mismatch} ranges carry a payload other than the micro-batch of their name")
    if any(marks[pid] for pid in pids) and not all(marks[pid] for pid in pids):
        bare = next(pid for pid in pids if not marks[pid])
        warnings.append(f"pid {bare} has no ITER ranges while other processes do; its ops count as iteration 0")
    stage_of = {pid: next(iter(stages[pid])) if with_stage else i for i, pid in enumerate(pids)}
    rank_of = _ranks(p, pids, stage_of, iter_ranks, warnings)
    ranks = []
    dropped = 0
    for pid in sorted(pids, key=rank_of.__getitem__):
        placed, d = assign_iterations(ops[pid], marks[pid])
        dropped += d
        if placed:
            ranks.append(RankTrace(rank_of[pid], stage_of[pid], pid, placed, dict(marks[pid])))
    if not ranks:
        raise BadInput(f"{p}: no '{DOMAIN}' op range lies inside an ITER range")
    if dropped:
        warnings.append(f"{dropped} op ranges outside every ITER range were left out")
    _check_stages(p, ranks)
    extra = {"session_start_utc_ns": session} if session is not None else {}
    return MeasuredTrace(str(p), ranks, warnings, extra)


def _ranks(p: Path, pids: list[int], stage_of: dict[int, int], iter_ranks: dict[int, set[int]],
           warnings: list[str]) -> dict[int, int]:
    """pid -> global rank: the ITER payload of each process, else the (stage, pid) order (see the contract)."""
    for pid in pids:
        if len(iter_ranks[pid]) > 1:
            raise BadInput(f"{p}: pid {pid} carries ITER ranges of ranks {sorted(iter_ranks[pid])}; one process is one rank")
    ranked = [pid for pid in pids if iter_ranks[pid]]
    if ranked:
        if len(ranked) != len(pids):
            bare = next(pid for pid in pids if not iter_ranks[pid])
            raise BadInput(f"{p}: pid {bare} has no rank payload on its ITER ranges while other processes do")
        rank_of = {pid: next(iter(iter_ranks[pid])) for pid in pids}
        seen: dict[int, int] = {}
        for pid in pids:
            if rank_of[pid] in seen:
                raise BadInput(f"{p}: pids {seen[rank_of[pid]]} and {pid} both say they are rank {rank_of[pid]} "
                               "(one export per job)")
            seen[rank_of[pid]] = pid
        return rank_of
    order = sorted(pids, key=lambda pid: (stage_of[pid], pid))
    shared = sorted({stage_of[pid] for pid in pids if sum(stage_of[q] == stage_of[pid] for q in pids) > 1})
    if shared:
        warnings.append(f"no rank payload on the ITER ranges: the processes of stage {shared[0]} are paired with "
                        "the other stages' in pid order")
    return {pid: i for i, pid in enumerate(order)}


def _check_stages(p: Path, ranks: list[RankTrace]) -> None:
    present = {r.stage for r in ranks}
    missing = [s for s in range(max(present) + 1) if s not in present]
    if missing:
        raise BadInput(f"{p}: no process carries stage {missing[0]}, but stage {max(present)} exists")

