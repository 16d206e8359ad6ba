"""The planner's compiled core (``plancore.c``, shipped beside this file): built on first use, called
through ctypes.

``lib()`` is the loaded library, or None when it cannot be had; callers then run their pure-Python
code, which computes the same schedules and times (tests/plan/test_native.py compares them on many
random cases). The source is compiled with the system C compiler (``$CC`` when set, else Python's
own, ``cc``, ``gcc`` or ``clang`` on PATH) into ``$DS_PIPEMORPH_CACHE`` (default
``$XDG_CACHE_HOME/ds_pipemorph``, else ``~/.cache/ds_pipemorph``, else a temp dir) as a plain shared
library: no Python headers, no build step at install. ``DS_PIPEMORPH_NATIVE=0`` turns it off.

The cached library's name is a hash of the source, the flags and the compiler (its path and
``--version``), and the library returns that hash (``pm_build_key``): a library built from other
source or by another compiler is never loaded as this one, and a corrupt or foreign file under the
name is rebuilt. A library is used only after it gave the Python code's answers on one small fixed
case. When there is no library, one log line says why and what it costs.

Pure Python otherwise: no torch, no numpy.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from array import array
from importlib import resources
from pathlib import Path
from typing import Optional

from ..ir.links import DIRECT, LATENCY, Delegated
from ..ir.ops import Kind, op_table, peak_inflight, warmup_counts
from ..ir.profile import Costs
from ..ir.memory import EPS as MEM_EPS
from .listsched_py import Policy, list_schedule_py
from .replay_py import run_py

logger = logging.getLogger(__name__)

SOURCE_FILE = "plancore.c"
# No fused multiply-adds, no fast-math: the same IEEE double operations as the Python code.
FLAGS = ["-O3", "-std=c99", "-pthread", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
THREADS = 8  # at most, for the link tolerances (one link per lane, 8 lanes per thread)
# What running without the core costs (benchmarks/planner/plan_core.py: 4x12 to 16x64 pipelines).
PYTHON_COST = "about 5-50x slower (more with more stages)"

_lib: Optional[ctypes.CDLL] = None
_tried = False
_dp = ctypes.POINTER(ctypes.c_double)
_ip = ctypes.POINTER(ctypes.c_int)


def enabled() -> bool:
    return os.environ.get("DS_PIPEMORPH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def source() -> bytes:
    """The C source, as installed with the package."""
    return resources.files(__package__).joinpath(SOURCE_FILE).read_bytes()


def _cache_dirs() -> list[Path]:
    env = os.environ.get("DS_PIPEMORPH_CACHE")
    if env:
        return [Path(env)]
    xdg = os.environ.get("XDG_CACHE_HOME")
    out = [Path(xdg) / "ds_pipemorph"] if xdg else []
    out.append(Path.home() / ".cache" / "ds_pipemorph")
    out.append(Path(tempfile.gettempdir()) / f"ds_pipemorph-{os.getuid() if hasattr(os, 'getuid') else 0}")
    return out


def _compiler() -> tuple[Optional[list[str]], str]:
    """(the compiler command, "") or (None, why there is none). ``$CC`` is taken as it is set (split
    as a shell would: ``ccache gcc``); without it, Python's own compiler, then cc, gcc, clang."""
    env = os.environ.get("CC", "").strip()
    if env:
        cmd = shlex.split(env)
        if shutil.which(cmd[0]):
            return cmd, ""
        return None, f"$CC names {cmd[0]}, which is not found"
    py = shlex.split(sysconfig.get_config_var("CC") or "")
    for cmd in ([py] if py else []) + [["cc"], ["gcc"], ["clang"]]:
        if shutil.which(cmd[0]):
            return cmd, ""
    return None, "no C compiler found"


def _compiler_id(cmd: list[str]) -> bytes:
    """What identifies the compiler: its resolved path, its arguments and its ``--version`` output."""
    path = os.path.realpath(shutil.which(cmd[0]) or cmd[0])
    try:
        r = subprocess.run([*cmd, "--version"], capture_output=True, timeout=60)
        version = r.stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    if not version:  # no --version: the binary itself stands for it
        st = os.stat(path)
        version = f"{st.st_size} {st.st_mtime_ns}".encode()
    return "\0".join([path, *cmd[1:]]).encode() + b"\0" + version


def build_key(src: bytes, cmd: list[str]) -> str:
    """The hash a library is cached under and carries: source, flags, platform and compiler."""
    h = hashlib.sha256()
    for part in (src, " ".join(FLAGS).encode(), sys.platform.encode(), _compiler_id(cmd)):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:32]


def _open(path: Path, key: str) -> Optional[ctypes.CDLL]:
    """The library at ``path`` if it loads and was built for ``key``, else None."""
    try:
        L = ctypes.CDLL(str(path))
        L.pm_build_key.restype = ctypes.c_char_p
        if L.pm_build_key() != key.encode():
            return None
    except (OSError, AttributeError):  # not a shared library, or not one of ours
        return None
    L.pm_list_schedule.restype = ctypes.c_int
    L.pm_replay.restype = ctypes.c_int
    return L


def _compile(cmd: list[str], src: bytes, key: str, d: Path, name: str) -> tuple[Optional[ctypes.CDLL], str]:
    """Build into ``d``: (the library, installed as ``d/name``, "") or (None, why not)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".so")
        os.close(fd)
    except OSError as e:
        return None, f"cache dir {d} is not usable: {e.strerror or e}"
    c_file = tmp[:-3] + ".c"
    try:
        Path(c_file).write_bytes(src)
        r = subprocess.run([*cmd, *FLAGS, f'-DPM_BUILD_KEY="{key}"', "-o", tmp, c_file],
                           capture_output=True, timeout=300)
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()
            return None, f"{cmd[0]} failed on {SOURCE_FILE}: {err[0] if err else f'exit {r.returncode}'}"
        # Loaded under its own temporary name: the loader would hand back a library of the final
        # name that this process loaded before (a stale one it rejected).
        L = _open(Path(tmp), key)
        if L is None:
            return None, f"the library {cmd[0]} built does not load"
        os.replace(tmp, d / name)  # atomic: concurrent builders each install a whole library
        return L, ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot build in {d}: {e}"
    finally:
        for f in (c_file, tmp):
            if os.path.exists(f):
                os.unlink(f)


def load(src: Optional[bytes] = None) -> Optional[ctypes.CDLL]:
    """Load the cached core or build it (``src``: the C source, by default the installed file); a
    library is returned only after it agreed with the Python code on a fixed case. None, with one
    log line saying why and what that costs, when there is none."""
    src = source() if src is None else src
    cmd, why = _compiler()
    if cmd is None:
        logger.warning("planner core not built (%s): replays run in Python, %s", why, PYTHON_COST)
        return None
    key = build_key(src, cmd)
    name = f"plancore-{key}.so"
    reasons = []
    for d in _cache_dirs():
        L = _open(d / name, key) if (d / name).is_file() else None
        if L is None:  # none there, or a stale or corrupt file: build (and replace it)
            L, why = _compile(cmd, src, key, d, name)
            if L is None:
                reasons.append(why)
                if why.startswith("cache dir"):
                    continue  # another place may do
                break  # the compiler itself failed: elsewhere it would too
        wrong = disagreement(L)
        if wrong is not None:
            logger.warning("planner core not used (it disagrees with the Python code on %s): replays run in "
                           "Python, %s", wrong, PYTHON_COST)
            return None
        return L
    logger.warning("planner core not built (%s): replays run in Python, %s", "; ".join(reasons), PYTHON_COST)
    return None


def disagreement(L: ctypes.CDLL) -> Optional[str]:
    """None if the library gives the Python code's schedule, times and peaks on one fixed case
    (3 stages, 5 micro-batches, uneven op times, every link model); else what differs."""
    S, N, x = 3, 5, [4, 3, 1]
    costs = Costs([3.0, 2.5, 4.25], [4.0, 5.5, 3.5], [2.0, 1.5, 3.0], [1.0, 7.5])
    pol = Policy()
    want = list_schedule_py(costs, N, x, pol)
    got = list_schedule(costs, N, x, pol.priority, pol.w_fits_gap, pol.late_w, L=L)
    if got is None or got[0] != want:
        return "the list scheduler's order"
    tight = Policy(w_fits_gap=True, late_w=frozenset({0}), units=(3.5, 2.0, 1.0), w_share=0.5)
    held = list_schedule(costs, N, [3, 2, 1], tight.priority, tight.w_fits_gap, tight.late_w, tight.units,
                         tight.w_share, L=L)
    if held is None or held[0] != list_schedule_py(costs, N, [3, 2, 1], tight):
        return "the list scheduler's order within a memory budget"
    enc = _encode(want, N)
    if peaks_and_warmups(enc, N, L) != (peak_inflight(want), warmup_counts(want)):
        return "the in-flight peaks"
    for fused in (False, True):
        for model in (LATENCY, DIRECT, Delegated(2)):
            models = (model,) * (S - 1)
            first, last, busy = run_py(want, costs, N, fused, None, models)
            rc, *res = replay(enc, costs, N, fused, models, L=L)[:4]
            if rc != 0 or any(abs(a - b) > 1e-9 for a, b in zip([first, last, *busy], [res[0], res[1], *res[2]])):
                return f"the replay ({type(model).__name__} links{', fused backward' if fused else ''})"
    return None


def lib() -> Optional[ctypes.CDLL]:
    """The compiled core, loaded (or built) on first call; None if disabled or it cannot be had."""
    global _lib, _tried
    if not enabled():
        return None
    if not _tried:
        _tried = True
        try:
            _lib = load()
        except Exception as e:  # noqa: BLE001 - any failure means: use the Python code
            logger.warning("planner core not built (%s): replays run in Python, %s", e, PYTHON_COST)
            _lib = None
    return _lib


def _d(a: array):
    """A pointer to ``a``'s buffer: the caller keeps ``a`` alive while the pointer is used."""
    return ctypes.cast(a.buffer_info()[0], _dp)


def _i(a: array):
    return ctypes.cast(a.buffer_info()[0], _ip)


def dbl(xs) -> array:
    return array("d", xs)


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


def peaks_and_warmups(enc: tuple[array, array], n: int, L=None) -> Optional[tuple[list[int], list[int]]]:
    """``ops.peak_inflight`` and ``ops.warmup_counts`` of an encoded schedule; None
    without the library."""
    L = L or lib()
    if L is None:
        return None
    lens, codes = enc
    peak, warm = array("i", bytes(4 * len(lens))), array("i", bytes(4 * len(lens)))
    L.pm_peak(len(lens), n, _i(lens), _i(codes), _i(peak), _i(warm))
    return peak.tolist(), warm.tolist()


def list_schedule(costs, n: int, warmup: list[int], priority: str, w_fits_gap: bool, late_w,
                  units=None, w_share: float = 1.0, L=None) -> Optional[tuple]:
    """``listsched_py.list_schedule_py`` in C: (schedule, its encoding), or None if it stalled (the
    caller re-runs the Python code for its error) or the library is missing."""
    L = L or lib()
    S = costs.stages
    if L is None or n < 1 or S < 1:
        return None
    if units is not None:  # what the Python scheduler refuses, refused before the C core reads anything
        if len(units) != S:
            raise ValueError(f"policy.units has {len(units)} values, expected {S}")
        for s in range(S):
            if warmup[s] > units[s] + MEM_EPS:
                raise ValueError(f"stage {s}: warm-up {warmup[s]} exceeds its memory of {units[s]:.6g} micro-batches")
    out = array("i", bytes(4 * S * 3 * n))
    stall = ctypes.c_double(0.0)
    pri = array("i", [Kind(k).code for k in priority])
    late = (ctypes.c_ubyte * S)(*[1 if s in late_w else 0 for s in range(S)])
    keep = (dbl(costs.f), dbl(costs.b), dbl(costs.w), dbl(list(costs.links) + [0.0]), array("i", warmup),
            None if units is None else dbl(units))
    rc = L.pm_list_schedule(
        S, n, *(_d(a) for a in keep[:4]), _i(keep[4]), _i(pri) if len(pri) else None, len(pri),
        int(bool(w_fits_gap)), late, None if keep[5] is None else _d(keep[5]), ctypes.c_double(w_share),
        _i(out), ctypes.byref(stall),
    )
    if rc != 0:
        return None
    ops = op_table(n)[0]
    codes = out.tolist()
    w3 = 3 * n
    return [[ops[c] for c in codes[s * w3:(s + 1) * w3]] for s in range(S)], (array("i", [w3] * S), out)


MODEL_CODES = {"Latency": 0, "Direct": 1, "Delegated": 2}


def replay(enc: tuple[array, array], costs, n: int, fused: bool, models: list, limit: Optional[float] = None,
           slots: bool = False, positions: bool = False, L=None):
    """``replay_py.run_py`` in C on an encoded schedule. Returns (rc, first, last, busy, ptr, slots,
    pos_start): rc 0 done, 1 stuck (ptr says where), 2 above ``limit``; None without the library."""
    L = L or lib()
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
