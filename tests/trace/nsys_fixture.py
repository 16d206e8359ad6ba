"""Small SQLite files in the Nsight Systems export schema, with known pipemorph NVTX ranges.

Tables and column names/types as ``nsys export --type sqlite`` writes them (NVTX_EVENTS, StringIds,
ThreadNames, TARGET_INFO_SESSION_START_TIME). Times are given in ms and stored in ns.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

DDL = """
CREATE TABLE StringIds (
    id          INTEGER   NOT NULL   PRIMARY KEY,
    value       TEXT      NOT NULL
);
CREATE TABLE NVTX_EVENTS (
    start       INTEGER   NOT NULL,
    end         INTEGER,
    eventType   INTEGER   NOT NULL,
    rangeId     INTEGER,
    category    INTEGER,
    color       INTEGER,
    text        TEXT,
    globalTid   INTEGER,
    endGlobalTid INTEGER,
    textId      INTEGER   REFERENCES StringIds(id),
    domainId    INTEGER,
    uint64Value INTEGER,
    int64Value  INTEGER,
    doubleValue REAL,
    uint32Value INTEGER,
    int32Value  INTEGER,
    floatValue  REAL,
    jsonTextId  INTEGER,
    jsonText    TEXT,
    binaryData  TEXT
);
CREATE TABLE ThreadNames (
    nameId      INTEGER   NOT NULL   REFERENCES StringIds(id),
    priority    INTEGER,
    globalTid   INTEGER
);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (
    utcEpochNs  INTEGER,
    utcTime     TEXT,
    localTime   TEXT
);
"""

CATEGORY, MARK, PUSH_POP, START_END, DOMAIN_CREATE = 33, 34, 59, 60, 75
MS = 1_000_000

# Two stages, two micro-batches; one iteration (ms from its start). Iteration 1 = the same + 100 ms.
STAGE0 = [("F0", 0, 10), ("SEND_F0", 10, 12), ("F1", 12, 22), ("SEND_F1", 22, 24), ("RECV_B0", 24, 40),
          ("B0", 40, 50), ("W0", 50, 60), ("RECV_B1", 60, 62), ("B1", 62, 72), ("W1", 72, 82)]
STAGE1 = [("RECV_F0", 0, 13), ("F0", 13, 23), ("B0", 23, 33), ("SEND_B0", 33, 38), ("RECV_F1", 38, 39),
          ("F1", 39, 49), ("B1", 49, 59), ("SEND_B1", 59, 61), ("W0", 61, 71), ("W1", 71, 81)]
ITERS = [(0, 0, 85), (1, 100, 190)]

# Three stages, one micro-batch, no ITER ranges, no categories.
THREE = [
    [("F0", 0, 10), ("SEND_F0", 10, 11), ("RECV_B0", 11, 53), ("B0", 53, 63), ("W0", 63, 73)],
    [("RECV_F0", 0, 12), ("F0", 12, 22), ("SEND_F0", 22, 24), ("RECV_B0", 24, 40), ("B0", 40, 50),
     ("SEND_B0", 50, 52), ("W0", 52, 62)],
    [("RECV_F0", 0, 30), ("F0", 30, 34), ("B0", 34, 36), ("SEND_B0", 36, 38), ("W0", 38, 42)],
]


def gtid(pid: int, tid: int | None = None, hw: int = 0, vm: int = 0) -> int:
    """globalTid = (hw << 56) | (vm << 48) | (pid << 24) | tid."""
    return (hw << 56) | (vm << 48) | (pid << 24) | (pid if tid is None else tid)


class NsysDB:
    def __init__(self, path: Path, registered: bool):
        self.path = Path(path)
        self.registered = registered
        self.con = sqlite3.connect(self.path)
        self.con.executescript(DDL)
        self.con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (1700000000000000000, '', '')")
        self.strings: dict[str, int] = {}

    def _sid(self, text: str) -> int:
        if text not in self.strings:
            self.strings[text] = len(self.strings) + 1
            self.con.execute("INSERT INTO StringIds (id, value) VALUES (?, ?)", (self.strings[text], text))
        return self.strings[text]

    def domain(self, g: int, domain_id: int, name: str) -> None:
        self.con.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) VALUES (0, ?, ?, ?, ?)",
                         (DOMAIN_CREATE, name, g, domain_id))

    def category(self, g: int, domain_id: int, cid: int, name: str) -> None:
        self.con.execute("INSERT INTO NVTX_EVENTS (start, eventType, category, text, globalTid, domainId) VALUES (0, ?, ?, ?, ?, ?)",
                         (CATEGORY, cid, name, g, domain_id))

    def range(self, g: int, domain_id: int, name: str, start_ms: float, end_ms: float | None,
              category: int | None = None, payload: int | None = None, event_type: int = PUSH_POP) -> None:
        text, text_id = (None, self._sid(name)) if self.registered else (name, None)
        self.con.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, category, color, text, globalTid, textId, domainId, int64Value)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (round(start_ms * MS), None if end_ms is None else round(end_ms * MS), event_type, category, 0xFF0000FF,
             text, g, text_id, domain_id, payload),
        )

    def close(self) -> Path:
        self.con.commit()
        self.con.close()
        return self.path


def _payload(name: str) -> int:
    return int(name.lstrip("SENDRCV_FBW"))


def two_stage(path: Path, registered: bool = True, replicas: int = 1, open_last_iter: bool = False) -> Path:
    """2 stages x ``replicas`` ranks, 2 iterations, categories 'stage0'/'stage1', ITER ranges.

    Process p (pid 100 + p) holds stage p % 2. Each process numbers the pipemorph domain
    differently (domain ids 1, 2, ...), and process 102 also creates a domain 'other' under id 1
    with look-alike ranges that must be ignored.
    """
    db = NsysDB(path, registered)
    for p in range(2 * replicas):
        pid, stage = 100 + p, p % 2
        g = gtid(pid)
        did = p + 1
        db.domain(g, did, "pipemorph")
        db.category(g, did, 7, f"stage{stage}")
        if pid == 102:
            db.domain(g, 1, "other")
            db.range(g, 1, "F0", 0, 500)
        for k, t0, t1 in ITERS:
            end = None if (open_last_iter and k == 1) else t1
            db.range(g, did, f"ITER{k}", t0, end, event_type=START_END)
            for name, s, e in (STAGE0 if stage == 0 else STAGE1):
                db.range(g, did, name, t0 + s, t0 + e, category=7, payload=_payload(name))
        db.range(g, did, "OptimizerStep", 86, 88, category=7)
    return db.close()


def three_stage(path: Path, registered: bool = False) -> Path:
    """3 stages, inline text, no categories, no ITER ranges; globalTid with hardware and VM ids."""
    db = NsysDB(path, registered)
    for s, rows in enumerate(THREE):
        g = gtid(100 + s, tid=100 + s + 7, hw=3, vm=1)
        db.domain(g, 1, "pipemorph")
        for name, a, b in rows:
            db.range(g, 1, name, a, b)
    return db.close()
