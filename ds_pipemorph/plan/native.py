"""The planner's compiled core (C source in ``_core_c.py``): built on first use, called through ctypes.

``lib()`` is the loaded library, or None when it cannot be had; callers then run their pure-Python
code, which computes the same schedules and times (tests/plan/test_native.py compares them on many
random cases). The source is compiled once per source version with the system C compiler (``cc``,
or ``$CC``) into ``$DS_PIPEMORPH_CACHE`` (default ``$XDG_CACHE_HOME/ds_pipemorph``, else
``~/.cache/ds_pipemorph``, else a temp dir) as a plain shared library: no Python headers, no build
step at install. ``DS_PIPEMORPH_NATIVE=0`` turns it off.

Pure Python otherwise: no torch, no numpy.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import zlib
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Optional

from .ops import Op

# No fused multiply-adds, no fast-math: the same IEEE double operations as the Python code.
FLAGS = ["-O3", "-std=c99", "-pthread", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
KINDS = "FBW"
THREADS = 8  # at most, for the link tolerances (one link per lane, 8 lanes per thread)

_lib: Optional[ctypes.CDLL] = None
_tried = False
_dp = ctypes.POINTER(ctypes.c_double)
_ip = ctypes.POINTER(ctypes.c_int)


def enabled() -> bool:
    return os.environ.get("DS_PIPEMORPH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dirs() -> list[Path]:
    env = os.environ.get("DS_PIPEMORPH_CACHE")
    if env:
        return [Path(env)]
    xdg = os.environ.get("XDG_CACHE_HOME")
    out = [Path(xdg) / "ds_pipemorph"] if xdg else []
    out.append(Path.home() / ".cache" / "ds_pipemorph")
    out.append(Path(tempfile.gettempdir()) / f"ds_pipemorph-{os.getuid() if hasattr(os, 'getuid') else 0}")
    return out


def _compiler() -> Optional[str]:
    import sysconfig

    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    exe = cc.split()[0] if cc.split() else "cc"
    if shutil.which(exe):
        return exe
    for alt in ("cc", "gcc", "clang"):
        if shutil.which(alt):
            return alt
    return None


def _build() -> Optional[ctypes.CDLL]:
    from ._core_c import SOURCE

    src = SOURCE.encode()
    cc = _compiler()
    if cc is None:
        return None
    key = src + " ".join(FLAGS).encode() + sys.platform.encode() + cc.encode()
    tag = f"{zlib.crc32(key):08x}{zlib.adler32(key):08x}"  # the library's name changes with any input
    name = f"plancore-{tag}.so"
    for d in _cache_dirs():
        so = d / name
        if so.is_file():
            try:
                return ctypes.CDLL(str(so))
            except OSError:
                pass
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".so")
            os.close(fd)
        except OSError:
            continue
        import subprocess

        try:
            c_file = tmp[:-3] + ".c"
            Path(c_file).write_bytes(src)
            try:
                r = subprocess.run([cc, *FLAGS, "-o", tmp, c_file], capture_output=True, timeout=120)
            finally:
                os.unlink(c_file)
            if r.returncode != 0:
                import logging

                err = r.stderr.decode(errors="replace").strip().splitlines()
                logging.getLogger(__name__).warning(
                    "the planner's C core did not compile with %s (%s); planning runs the slower pure-Python "
                    "code (DS_PIPEMORPH_NATIVE=0 skips the attempt)", cc, err[0] if err else f"exit {r.returncode}")
                return None
            os.replace(tmp, so)  # atomic: concurrent builders each install a whole library
            return ctypes.CDLL(str(so))
        except (OSError, subprocess.SubprocessError):
            continue
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


def lib() -> Optional[ctypes.CDLL]:
    """The compiled core, built on first call; None if disabled or it cannot be built."""
    global _lib, _tried
    if not enabled():
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception:  # noqa: BLE001 - any failure means: use the Python code
            _lib = None
        if _lib is not None:
            _lib.pm_list_schedule.restype = ctypes.c_int
            _lib.pm_replay.restype = ctypes.c_int
    return _lib


def _d(a: array):
    """A pointer to ``a``'s buffer: the caller keeps ``a`` alive while the pointer is used."""
    return ctypes.cast(a.buffer_info()[0], _dp)


def _i(a: array):
    return ctypes.cast(a.buffer_info()[0], _ip)


def dbl(xs) -> array:
    return array("d", xs)


@lru_cache(maxsize=8)
def op_table(n: int) -> tuple[tuple[Op, ...], dict]:
    """Ops by code (kind * n + m) and codes by op, for n micro-batches."""
    ops = tuple(Op(k, m) for k in KINDS for m in range(n))
    return ops, {op: i for i, op in enumerate(ops)}


_ENCODED: list = []  # (schedule, copy of its rows, n, encoding) of the last few schedules encoded


def remember(schedule, n: int, enc) -> None:
    """Keep ``enc`` as the encoding of ``schedule`` for ``encode`` (checked equal when used)."""
    if enc is None:
        return
    _ENCODED.insert(0, (schedule, [list(r) for r in schedule], n, enc))
    del _ENCODED[4:]


def encode(schedule, n: int) -> Optional[tuple[array, array]]:
    """(row lengths, concatenated op codes), or None if some op is not a stage-local F/B/W of a
    micro-batch below n (the Python code then says what is wrong). A schedule encoded a moment
    ago (the same object, still equal to what it was) is not encoded again."""
    if n < 1:
        return None
    for sched, rows, m, enc in _ENCODED:
        if sched is schedule and m == n and rows == schedule:  # same ops: mostly identity checks
            return enc
    enc = _encode(schedule, n)
    remember(schedule, n, enc)
    return enc


def _encode(schedule, n: int) -> Optional[tuple[array, array]]:
    get = op_table(n)[1].get
    codes = array("i")
    lens = array("i")
    try:
        for row in schedule:
            codes.extend(map(get, row))  # a None (unknown op) raises TypeError
            lens.append(len(row))
    except (TypeError, OverflowError):  # unknown or unhashable ops
        return None
    return lens, codes


def peaks_and_warmups(enc: tuple[array, array], n: int) -> Optional[tuple[list[int], list[int]]]:
    """``simulate.peak_inflight`` and ``simulate.warmup_counts`` of an encoded schedule; None
    without the library."""
    L = lib()
    if L is None:
        return None
    lens, codes = enc
    peak, warm = array("i", bytes(4 * len(lens))), array("i", bytes(4 * len(lens)))
    L.pm_peak(len(lens), n, _i(lens), _i(codes), _i(peak), _i(warm))
    return peak.tolist(), warm.tolist()


def list_schedule(costs, n: int, warmup: list[int], priority: str, w_fits_gap: bool, late_w) -> Optional[tuple]:
    """``listsched.list_schedule_py`` in C: (schedule, its encoding), or None if it stalled (the
    caller re-runs the Python code for its error) or the library is missing."""
    L = lib()
    S = costs.stages
    if L is None or n < 1 or S < 1:
        return None
    out = array("i", bytes(4 * S * 3 * n))
    stall = ctypes.c_double(0.0)
    pri = array("i", [0 if k == "F" else 1 if k == "B" else 2 for k in priority])
    late = (ctypes.c_ubyte * S)(*[1 if s in late_w else 0 for s in range(S)])
    keep = (dbl(costs.f), dbl(costs.b), dbl(costs.w), dbl(list(costs.links) + [0.0]), array("i", warmup))
    rc = L.pm_list_schedule(
        S, n, *(_d(a) for a in keep[:4]), _i(keep[4]), _i(pri) if len(pri) else None, len(pri),
        int(bool(w_fits_gap)), late, _i(out), ctypes.byref(stall),
    )
    if rc != 0:
        return None
    ops = op_table(n)[0]
    codes = out.tolist()
    w3 = 3 * n
    return [[ops[c] for c in codes[s * w3:(s + 1) * w3]] for s in range(S)], (array("i", [w3] * S), out)


MODEL_CODES = {"Latency": 0, "Direct": 1, "Delegated": 2}


def replay(enc: tuple[array, array], costs, n: int, fused: bool, models: list, limit: Optional[float] = None,
           slots: bool = False, positions: bool = False):
    """``simulate._run`` in C on an encoded schedule. Returns (rc, first, last, busy, ptr, slots,
    pos_start): rc 0 done, 1 stuck (ptr says where), 2 above ``limit``; None without the library."""
    L = lib()
    if L is None:
        return None
    lens, codes = enc
    S = len(lens)
    total = len(codes)
    model = array("i", [MODEL_CODES[type(h).__name__] for h in models] + [0])
    queues = array("i", [getattr(h, "queues", 0) for h in models] + [0])
    res = array("d", [0.0, 0.0])
    busy = array("d", bytes(8 * S))
    ptr = array("i", bytes(4 * S))
    if slots:
        ss, sp = array("i", bytes(4 * total)), array("i", bytes(4 * total))
        st, se = array("d", bytes(8 * total)), array("d", bytes(8 * total))
        sargs = (_i(ss), _i(sp), _d(st), _d(se))
    else:
        sargs = (None, None, None, None)
    pos = array("d", bytes(8 * total)) if positions else None
    keep = (dbl(costs.f), dbl(costs.b), dbl(costs.w), dbl(list(costs.links) + [0.0]))  # alive during the call
    rc = L.pm_replay(
        S, n, _i(lens), _i(codes), *(_d(a) for a in keep), _i(model), _i(queues), int(bool(fused)),
        ctypes.c_double(-1.0 if limit is None else limit), _d(res), _d(busy), _i(ptr), *sargs,
        _d(pos) if positions else None,
    )
    if rc < 0:
        return None
    return rc, res[0], res[1], busy.tolist(), ptr.tolist(), ((ss, sp, st, se) if slots else None), pos


def tolerances(enc: tuple[array, array], costs, n: int, fused: bool, links: list[int], res: float):
    """``tolerance._replay_tolerance`` of each of ``links`` under pure latency, by Newton steps in C
    (``pm_tolerance``): a list of delays, None where the steps stalled (the caller then searches
    itself); None if the schedule is stuck or the library is missing."""
    L = lib()
    if L is None or not links:
        return None
    lens, codes = enc
    q = array("i", links)
    out, how = array("d", bytes(8 * len(q))), array("i", bytes(4 * len(q)))
    keep = (dbl(costs.f), dbl(costs.b), dbl(costs.w), dbl(list(costs.links) + [0.0]))
    threads = max(1, min(THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    rc = L.pm_tolerance(len(lens), n, _i(lens), _i(codes), *(_d(a) for a in keep), int(bool(fused)), len(q),
                        _i(q), ctypes.c_double(res), threads, _d(out), _i(how))
    if rc != 0:
        return None
    return [None if h else v for v, h in zip(out.tolist(), how.tolist())]
