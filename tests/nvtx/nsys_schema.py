"""Writes SQLite files in the schema of ``nsys export --type sqlite`` (the NVTX part of it).

Tables and columns as the Nsight Systems SQLite export documents them: ``StringIds``,
``NVTX_EVENTS`` (one row per NVTX event: ranges, category names, domain creations),
``ENUM_NSYS_EVENT_TYPE``, ``ThreadNames`` and ``TARGET_INFO_SESSION_START_TIME``. Times are ns on the
session clock; ``globalTid`` packs ``(hw << 56) | (vm << 48) | (pid << 24) | tid``; a registered
string's text is in ``StringIds`` (``textId``), an unregistered one inline in ``text``; the payload
goes to the column of its NVTX type (``int64Value`` for ``NVTX_PAYLOAD_TYPE_INT64``, ...).
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Optional

DDL = """
CREATE TABLE StringIds (
    id          INTEGER   NOT NULL   PRIMARY KEY,
    value       TEXT      NOT NULL
);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (
    id          INTEGER   NOT NULL   PRIMARY KEY,
    name        TEXT      NOT NULL,
    label       TEXT      NOT NULL
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
EVENT_TYPES = [(CATEGORY, "NvtxCategory", "NVTX Category"), (MARK, "NvtxMark", "NVTX Mark"),
               (PUSH_POP, "NvtxPushPopRange", "NVTX PushPop Range"), (START_END, "NvtxStartEndRange", "NVTX StartEnd Range"),
               (DOMAIN_CREATE, "NvtxDomainCreate", "NVTX Domain Create")]
# nvtxPayloadType_t -> the NVTX_EVENTS column that holds that payload.
PAYLOAD_COLUMN = {1: "uint64Value", 2: "int64Value", 3: "doubleValue", 4: "uint32Value", 5: "int32Value", 6: "floatValue"}
INT64 = 2


def gtid(pid: int, tid: Optional[int] = None, hw: int = 0, vm: int = 0) -> int:
    """nsys's serialized thread id: ``(hw << 56) | (vm << 48) | (pid << 24) | tid``."""
    return (hw << 56) | (vm << 48) | (pid << 24) | (pid if tid is None else tid)


class NsysExport:
    """One export file; ``close()`` commits it and returns its path."""

    def __init__(self, path: Path, session_start_utc_ns: Optional[int] = None):
        self.path = Path(path)
        self.con = sqlite3.connect(self.path)
        self.con.executescript(DDL)
        self.con.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)", EVENT_TYPES)
        if session_start_utc_ns is not None:
            self.con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')", (session_start_utc_ns,))
        self.strings: dict[str, int] = {}

    def string_id(self, text: str) -> int:
        if text not in self.strings:
            self.strings[text] = len(self.strings) + 1
            self.con.execute("INSERT INTO StringIds (id, value) VALUES (?, ?)", (self.strings[text], text))
        return self.strings[text]

    def domain(self, g: int, start: int, domain_id: int, name: str) -> None:
        self.con.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) VALUES (?, ?, ?, ?, ?)",
                         (start, DOMAIN_CREATE, name, g, domain_id))

    def category(self, g: int, start: int, domain_id: int, category: int, name: str) -> None:
        self.con.execute("INSERT INTO NVTX_EVENTS (start, eventType, category, text, globalTid, domainId) VALUES (?, ?, ?, ?, ?, ?)",
                         (start, CATEGORY, category, name, g, domain_id))

    def range(self, g: int, domain_id: int, start: int, end: Optional[int], *, text: Optional[str] = None,
              registered: Optional[str] = None, category: Optional[int] = None, color: Optional[int] = None,
              payload_type: int = 0, payload=None, event_type: int = PUSH_POP, range_id: Optional[int] = None,
              end_g: Optional[int] = None) -> None:
        """A push/pop (59) or start/end (60) range; ``registered`` is a message given as a registered string."""
        cols = {"start": start, "end": end, "eventType": event_type, "category": category or None, "color": color,
                "text": text, "globalTid": g, "domainId": domain_id,
                "textId": None if registered is None else self.string_id(registered)}
        if event_type == START_END:
            cols.update(rangeId=range_id, endGlobalTid=end_g)
        if payload is not None and payload_type in PAYLOAD_COLUMN:
            cols[PAYLOAD_COLUMN[payload_type]] = payload
        names = ", ".join(cols)
        self.con.execute(f"INSERT INTO NVTX_EVENTS ({names}) VALUES ({', '.join('?' * len(cols))})", tuple(cols.values()))

    def close(self) -> Path:
        self.con.commit()
        self.con.close()
        return self.path
