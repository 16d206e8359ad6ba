"""Capture the NVTX calls of real processes without Nsight Systems, and write them as an nsys export.

``build_injection(dir)`` compiles ``nvtx_recorder.c`` (an NVTX v3 injection library) with the
system C compiler against the NVTX headers found on the machine; a process started with
``injection_env(lib, record_dir)`` records every NVTX call into ``record_dir/nvtx.<pid>.tsv``.
``read_process(path)`` parses one such file into ranges; ``export_sqlite(record_dir, out)`` writes
all of them into the tables of ``nsys export --type sqlite`` as Nsight Systems would (push/pop
ranges as eventType 59, start/end as 60, category names 33, domain creations 75, registered
strings in StringIds, payloads in the column of their type, times on one session clock).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from nsys_schema import PUSH_POP, START_END, NsysExport, gtid

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "nvtx_recorder.c"
_ARGB = 1  # NVTX_COLOR_ARGB
_REGISTERED, _ASCII = 3, 1  # NVTX_MESSAGE_TYPE_*


def nvtx_include_dir() -> Optional[Path]:
    """A directory holding ``nvtx3/nvToolsExt.h``: CUDA toolkits, next to nvcc, or system headers."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        candidates += [str(real.parent.parent)]
    candidates += sorted(glob.glob("/usr/local/cuda*"), reverse=True) + ["/usr", "/opt/nvidia"]
    candidates += [str(Path(p) / "nvidia" / "nvtx") for p in sys.path if p]  # the nvidia-nvtx wheels
    for c in candidates:
        if c and (Path(c) / "include" / "nvtx3" / "nvToolsExt.h").is_file():
            return Path(c) / "include"
    return None


def c_compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def unavailable_reason() -> Optional[str]:
    """Why the injection cannot be built here (None when it can)."""
    if c_compiler() is None:
        return "no C compiler (cc, gcc or clang) to build the NVTX injection library"
    if nvtx_include_dir() is None:
        return "no NVTX v3 headers (nvtx3/nvToolsExt.h) in a CUDA toolkit or /usr/include"
    return None


def build_injection(out_dir: Path) -> Path:
    """Compile the injection library into ``out_dir`` and return its path."""
    lib = Path(out_dir) / "libnvtx_recorder.so"
    cmd = [c_compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-fvisibility=hidden",
           f"-I{nvtx_include_dir()}", "-o", str(lib), str(SOURCE), "-lpthread"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"building the NVTX injection failed:\n{' '.join(cmd)}\n{p.stderr}")
    return lib


def injection_env(lib: Path, record_dir: Path) -> dict:
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    return {"NVTX_INJECTION64_PATH": str(lib), "NVTX_RECORD_DIR": str(record_dir)}


# ------------------------------------------------------------------------------------ records


@dataclass
class Range:
    """One NVTX range as the process opened and closed it (times: CLOCK_MONOTONIC ns)."""
    domain: str  # the domain's name ("" for NVTX's default domain)
    domain_id: int  # the handle the injection gave it (0: the default domain)
    message: Optional[str]
    registered: bool  # the message came as a registered string (nvtxDomainRegisterStringA)
    category: Optional[str]  # the name given with nvtxDomainNameCategoryA, else the id as text
    category_id: int
    payload_type: int
    payload: Optional[float]
    color: Optional[int]
    tid: int
    start: int
    end: Optional[int]  # None: never closed
    kind: str  # "push_pop" or "start_end"
    end_tid: Optional[int] = None
    depth: int = 0  # push/pop nesting depth on its thread and domain when it opened


@dataclass
class Process:
    pid: int
    realtime_ns: int
    monotonic_ns: int  # the clock pair taken when the injection attached
    domains: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # id -> (name, tid, t)
    strings: dict[int, str] = field(default_factory=dict)
    categories: list[tuple[int, int, int, int, str]] = field(default_factory=list)  # (domain, id, tid, t, name)
    ranges: list[Range] = field(default_factory=list)

    def in_domain(self, name: str) -> list[Range]:
        return [r for r in self.ranges if r.domain == name]


def _attributes(fields: list[str], p: Process) -> dict:
    cat, color_type, color, ptype, payload, mtype, message = fields[:7]
    ptype, mtype, cat = int(ptype), int(mtype), int(cat)
    value = None
    if payload != "":
        value = float(payload) if ptype in (3, 6) else int(payload)
    text = None
    if mtype == _REGISTERED:
        text = p.strings[int(message)]
    elif mtype == _ASCII:
        text = message
    return {"category_id": cat, "color": int(color) if int(color_type) == _ARGB else None, "payload_type": ptype,
            "payload": value, "message": text, "registered": mtype == _REGISTERED}


def read_process(path: Path) -> Process:
    """Parse one ``nvtx.<pid>.tsv`` and pair pushes with pops (per thread and domain) and starts with ends."""
    pid = int(Path(path).name.split(".")[1])
    proc: Optional[Process] = None
    stacks: dict[tuple[int, int], list[Range]] = {}
    started: dict[int, Range] = {}
    cat_names: dict[tuple[int, int], str] = {}

    def name_of(domain: int) -> str:
        return proc.domains[domain][0] if domain in proc.domains else ""

    for line in Path(path).read_text().splitlines():
        f = line.split("\t")
        if f[0] == "T":
            if proc is None:
                proc = Process(pid, int(f[1]), int(f[2]))
            continue
        tid, t, domain = int(f[1]), int(f[2]), int(f[3])
        if f[0] == "D":
            proc.domains[domain] = (f[4], tid, t)
        elif f[0] == "S":
            proc.strings[int(f[4])] = f[5]
        elif f[0] == "C":
            proc.categories.append((domain, int(f[4]), tid, t, f[5]))
            cat_names[(domain, int(f[4]))] = f[5]
        elif f[0] in "PA":
            rest = f[5:] if f[0] == "A" else f[4:]
            a = _attributes(rest, proc)
            cat = cat_names.get((domain, a["category_id"]), str(a["category_id"]) if a["category_id"] else None)
            stack = stacks.setdefault((tid, domain), [])
            r = Range(name_of(domain), domain, a["message"], a["registered"], cat, a["category_id"], a["payload_type"],
                      a["payload"], a["color"], tid, t, None, "push_pop" if f[0] == "P" else "start_end",
                      depth=len(stack) if f[0] == "P" else 0)
            proc.ranges.append(r)
            if f[0] == "P":
                stack.append(r)
            else:
                started[int(f[4])] = r
        elif f[0] == "O":
            stack = stacks.get((tid, domain))
            if stack:
                stack.pop().end = t
        elif f[0] == "E":
            r = started.pop(int(f[4]), None)
            if r is not None:
                r.end, r.end_tid = t, tid
    if proc is None:
        raise ValueError(f"{path}: no clock line; not written by nvtx_recorder.c")
    return proc


def read_all(record_dir: Path) -> list[Process]:
    return [read_process(p) for p in sorted(Path(record_dir).glob("nvtx.*.tsv"))]


def export_sqlite(record_dir: Path, out: Path) -> Path:
    """All recorded processes as one ``nsys export --type sqlite`` file (session clock from the first event)."""
    procs = read_all(record_dir)
    if not procs:
        raise ValueError(f"{record_dir}: no nvtx.<pid>.tsv files (was the injection loaded?)")
    origin = min(p.monotonic_ns for p in procs)
    first = min(procs, key=lambda p: p.monotonic_ns)
    db = NsysExport(out, session_start_utc_ns=first.realtime_ns - (first.monotonic_ns - origin))
    for p in procs:
        for did, (name, tid, t) in sorted(p.domains.items()):
            db.domain(gtid(p.pid, tid), t - origin, did, name)
        for did, cid, tid, t, name in p.categories:
            db.category(gtid(p.pid, tid), t - origin, did, cid, name)
        for rid, r in enumerate(p.ranges, 1):
            msg = {"registered": r.message} if r.registered else {"text": r.message}
            db.range(gtid(p.pid, r.tid), r.domain_id, r.start - origin, None if r.end is None else r.end - origin,
                     category=r.category_id, color=r.color, payload_type=r.payload_type, payload=r.payload,
                     event_type=PUSH_POP if r.kind == "push_pop" else START_END, range_id=rid,
                     end_g=None if r.end_tid is None else gtid(p.pid, r.end_tid), **msg)
    return db.close()
