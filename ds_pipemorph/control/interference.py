"""Predicting a stage's slowdown under interference from cheap runtime statistics (DynPipe §V-A).

A rank co-located with other work (another job's processes, a memory-bandwidth hog, a noisy
neighbour) runs its ops slower than alone. A re-partition needs the slowdown the stage would see
for a *candidate* amount of work (a candidate number of layers, i.e. a candidate solo op time),
not only the slowdown its current work shows now. DynPipe fits a random forest from runtime
statistics to the measured slowdown; this module is that piece on a CPU host:

* ``HostCounters`` / ``read_host``: what a rank reads for free (its wall and process CPU clocks,
  the machine's busy and total CPU time and runnable-process count from ``/proc/stat``, the
  1-minute load average) plus ``memcpy_probe_ms``, the time of a fixed small copy (a memory
  bandwidth proxy);
* ``InterferenceFeatures`` / ``extract_features``: the feature vector of one window, from two
  counter snapshots, the window's op records (per op kind: measured ms and solo ms) and the
  candidate's solo op time; ``FEATURE_NAMES`` is its fixed order;
* ``persistence_baseline``: "the slowdown the current work shows now persists" (for any candidate);
* ``SlowdownModel``: a scikit-learn ``RandomForestRegressor`` from features to the slowdown of the
  candidate over the next window (``fit``, ``predict``, ``save``/``load``, versioned).

The slowdown of some work over a window is its measured op time divided by its solo (uncontended)
op time, both summed over the window's ops: 1.0 = as fast as alone.

Pure Python: no torch, no deepspeed; scikit-learn and joblib are imported inside the functions
that need them (the ``interference`` extra), so importing this module is cheap.
"""
from __future__ import annotations

import math
import os
import pickle
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Union

FORMAT = "ds_pipemorph.control.interference.SlowdownModel"
FORMAT_VERSION = 1
LATEST_SHARE = 0.25  # ``latest_slowdown``: the last quarter of the window's ops
TARGETS = ("slowdown", "ratio")


# ---------------------------------------------------------------------------------------------
# What a rank can read cheaply


@dataclass(frozen=True)
class HostCounters:
    """One snapshot of cumulative counters (all seconds are cumulative since some origin).

    ``wall_s``: a monotonic clock; ``proc_cpu_s``: this process's CPU time (user + system, every
    thread); ``machine_busy_s`` / ``machine_total_s``: CPU time of the whole machine summed over its
    cores, busy (not idle, not iowait) and in all; ``runnable``: processes runnable now (this one
    included, ``procs_running`` of ``/proc/stat``); ``load1``: 1-minute load average; ``cores``:
    logical CPUs."""

    wall_s: float
    proc_cpu_s: float
    machine_busy_s: float
    machine_total_s: float
    runnable: int
    load1: float
    cores: int


def _proc_stat() -> tuple[float, float, int]:
    """(busy seconds, total seconds, runnable processes) from /proc/stat."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = total = 0.0
    running = 1
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                v = [float(x) for x in line.split()[1:]]
                # user nice system idle iowait irq softirq steal [guest guest_nice]: guest is already in user
                v = v[:8] + [0.0] * (8 - len(v[:8]))
                total = sum(v)
                busy = total - v[3] - v[4]
            elif line.startswith("procs_running"):
                running = int(line.split()[1])
    return busy / hz, total / hz, running


def read_host() -> HostCounters:
    """The counters now (Linux ``/proc``; elsewhere machine CPU and runnable count read as this
    process alone, which makes ``others_busy`` 0 and ``runnable_per_core`` the load average)."""
    wall = time.monotonic()
    t = os.times()
    proc = t.user + t.system
    cores = os.cpu_count() or 1
    try:
        load1 = os.getloadavg()[0]
    except (OSError, AttributeError):
        load1 = 0.0
    try:
        busy, total, running = _proc_stat()
    except OSError:
        busy, total, running = proc, wall * cores, max(1, round(load1))
    return HostCounters(wall, proc, busy, total, running, load1, cores)


_PROBE: dict[int, tuple[bytearray, bytearray]] = {}


def memcpy_probe_ms(nbytes: int = 8 << 20, repeats: int = 3) -> float:
    """Median time in ms of copying ``nbytes`` between two fixed buffers (a memory bandwidth proxy:
    its ratio to the uncontended time rises when another process saturates the memory bus)."""
    if nbytes not in _PROBE:
        _PROBE[nbytes] = (bytearray(os.urandom(1024)) * (nbytes // 1024), bytearray(nbytes - nbytes % 1024))
    src, dst = _PROBE[nbytes]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst[:] = src
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The feature vector


@dataclass(frozen=True)
class InterferenceFeatures:
    """What the model sees about one window of a rank and one candidate amount of work.

    ``candidate_ms``: solo op time of the candidate work (per op, summed over the kinds it runs);
    ``current_ms``: solo op time of the work the rank ran in the window (same convention);
    ``recent_slowdown``: the window's measured op time / solo op time (all kinds together);
    ``latest_slowdown``: the same over the last quarter of the window's ops (a change shows here first);
    ``slowdown_jitter``: coefficient of variation of the per-op slowdowns (contention is uneven);
    ``cpu_share``: process CPU seconds / wall seconds over the window;
    ``others_busy``: share of the machine's CPU time busy with anything but this process (0..1);
    ``runnable_per_core``: other runnable processes at the window's end per core;
    ``load1_per_core``: the 1-minute load average per core (slow, but sees what came and went);
    ``memprobe_ratio``: ``memcpy_probe_ms`` now / its uncontended value.
    """

    candidate_ms: float
    current_ms: float
    recent_slowdown: float
    latest_slowdown: float
    slowdown_jitter: float
    cpu_share: float
    others_busy: float
    runnable_per_core: float
    load1_per_core: float
    memprobe_ratio: float

    def vector(self) -> list[float]:
        return [float(getattr(self, n)) for n in FEATURE_NAMES]

    def with_candidate(self, candidate_ms: float) -> "InterferenceFeatures":
        """The same window, asked about another candidate amount of work."""
        return InterferenceFeatures(**{**asdict(self), "candidate_ms": float(candidate_ms)})


FEATURE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(InterferenceFeatures))


def extract_features(before: HostCounters, after: HostCounters,
                     ops: Sequence[tuple[str, float]], solo_ms: Mapping[str, float],
                     candidate_ms: float, probe_ms: float, probe_solo_ms: float) -> InterferenceFeatures:
    """The features of the window between two snapshots.

    ``ops``: the window's ops in the order they ran, as (kind, measured ms), e.g. ("F", 12.1);
    ``solo_ms``: per kind, the uncontended time of one op of the current work; ``candidate_ms``: the
    candidate's solo op time; ``probe_ms``/``probe_solo_ms``: ``memcpy_probe_ms`` at the window's
    end and uncontended. Raises ValueError for an empty window, an op kind without a solo time or
    snapshots out of order."""
    if not ops:
        raise ValueError("a window needs at least one op")
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        raise ValueError("the snapshot 'after' must be later than 'before'")
    missing = sorted({k for k, _ in ops if solo_ms.get(k, 0) <= 0})
    if missing:
        raise ValueError(f"no positive solo time for op kind(s) {missing}")
    ratios = [ms / solo_ms[k] for k, ms in ops]
    recent = sum(ms for _, ms in ops) / sum(solo_ms[k] for k, _ in ops)
    tail = ops[len(ops) - max(1, math.ceil(LATEST_SHARE * len(ops))):]
    latest = sum(ms for _, ms in tail) / sum(solo_ms[k] for k, _ in tail)
    mean = statistics.fmean(ratios)
    jitter = statistics.pstdev(ratios) / mean if len(ratios) > 1 else 0.0
    kinds = sorted({k for k, _ in ops})
    cores = max(1, after.cores)
    own = after.proc_cpu_s - before.proc_cpu_s
    busy = after.machine_busy_s - before.machine_busy_s
    total = after.machine_total_s - before.machine_total_s
    others = (busy - own) / total if total > 0 else 0.0
    return InterferenceFeatures(
        candidate_ms=float(candidate_ms),
        current_ms=float(sum(solo_ms[k] for k in kinds)),
        recent_slowdown=recent,
        latest_slowdown=latest,
        slowdown_jitter=jitter,
        cpu_share=own / wall,
        others_busy=min(1.0, max(0.0, others)),
        runnable_per_core=max(0, after.runnable - 1) / cores,
        load1_per_core=after.load1 / cores,
        memprobe_ratio=probe_ms / probe_solo_ms if probe_solo_ms > 0 else 1.0,
    )


def window_slowdown(ops: Sequence[tuple[str, float]], solo_ms: Mapping[str, float]) -> float:
    """The slowdown of a window's ops: measured time / solo time, summed over the ops (the target)."""
    return sum(ms for _, ms in ops) / sum(solo_ms[k] for k, _ in ops)


# ---------------------------------------------------------------------------------------------
# Predictors

Rows = Sequence[Union[InterferenceFeatures, Sequence[float]]]


def _matrix(rows: Rows) -> list[list[float]]:
    out = []
    for r in rows:
        v = r.vector() if isinstance(r, InterferenceFeatures) else [float(x) for x in r]
        if len(v) != len(FEATURE_NAMES):
            raise ValueError(f"a feature row has {len(v)} values, expected {len(FEATURE_NAMES)} ({', '.join(FEATURE_NAMES)})")
        out.append(v)
    return out


_RECENT = FEATURE_NAMES.index("recent_slowdown")


def persistence_baseline(rows: Rows) -> list[float]:
    """"The current slowdown persists": each row's ``recent_slowdown``, whatever the candidate."""
    return [v[_RECENT] for v in _matrix(rows)]


def _require_sklearn():
    try:
        from sklearn.ensemble import RandomForestRegressor
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("SlowdownModel needs scikit-learn: pip install 'ds_pipemorph[interference]'") from e
    return RandomForestRegressor


class SlowdownModel:
    """A random forest from ``InterferenceFeatures`` to the candidate's slowdown over the next window.

    ``target="slowdown"`` learns the slowdown itself (DynPipe); ``"ratio"`` learns
    log(slowdown / recent_slowdown), a correction of the persistence baseline, which keeps its
    answers proportional to the current slowdown beyond the range seen in training (a forest
    cannot extrapolate). Defaults follow the paper's forest (128 trees); ``random_state`` makes a
    fit reproducible."""

    def __init__(self, target: str = "slowdown", n_estimators: int = 128, min_samples_leaf: int = 2,
                 max_features: Optional[Union[float, str]] = 1.0, random_state: int = 0):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
        self.target = target
        self.params = {"n_estimators": n_estimators, "min_samples_leaf": min_samples_leaf,
                       "max_features": max_features, "random_state": random_state}
        self.estimator = None
        self.trained_on = 0

    def fit(self, rows: Rows, slowdowns: Sequence[float]) -> "SlowdownModel":
        X = _matrix(rows)
        y = [float(s) for s in slowdowns]
        if len(X) != len(y) or not X:
            raise ValueError(f"need as many slowdowns as feature rows, and at least one ({len(X)} rows, {len(y)} slowdowns)")
        if any(not s > 0 for s in y):
            raise ValueError("slowdowns must be positive")
        if self.target == "ratio":
            y = [math.log(s / max(v[_RECENT], 1e-9)) for s, v in zip(y, X)]
        est = _require_sklearn()(n_jobs=1, **self.params)
        est.fit(X, y)
        self.estimator, self.trained_on = est, len(X)
        return self

    def predict(self, rows: Rows) -> list[float]:
        if self.estimator is None:
            raise RuntimeError("SlowdownModel.predict before fit (or load)")
        X = _matrix(rows)
        if not X:
            return []
        raw = [float(p) for p in self.estimator.predict(X)]
        if self.target == "ratio":
            return [v[_RECENT] * math.exp(p) for p, v in zip(raw, X)]
        return raw

    def predict_one(self, features: InterferenceFeatures) -> float:
        return self.predict([features])[0]

    # -- persistence: a versioned pickle (joblib when present, it stores numpy arrays compactly) --

    def save(self, path: Union[str, Path]) -> None:
        if self.estimator is None:
            raise RuntimeError("SlowdownModel.save before fit")
        import sklearn

        payload = {"format": FORMAT, "version": FORMAT_VERSION, "features": list(FEATURE_NAMES),
                   "target": self.target, "params": self.params, "trained_on": self.trained_on,
                   "sklearn": sklearn.__version__, "estimator": self.estimator}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            import joblib
            joblib.dump(payload, tmp)
        except ImportError:  # pragma: no cover - joblib comes with scikit-learn
            with open(tmp, "wb") as f:
                pickle.dump(payload, f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "SlowdownModel":
        """A saved model; ValueError when the file is not one, or was written for another format
        version or feature vector (a model must see the features it was trained on, in order).
        Loading unpickles: load only files you trust."""
        _require_sklearn()
        try:
            import joblib
            payload = joblib.load(path)
        except ImportError:  # pragma: no cover
            with open(path, "rb") as f:
                payload = pickle.load(f)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError(f"{path}: not a saved SlowdownModel")
        if payload.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: SlowdownModel format version {payload.get('version')}, this code reads {FORMAT_VERSION}")
        if tuple(payload.get("features", ())) != FEATURE_NAMES:
            raise ValueError(f"{path}: trained on features {payload.get('features')}, this code has {list(FEATURE_NAMES)}")
        model = cls(target=payload["target"], **payload["params"])
        model.estimator, model.trained_on = payload["estimator"], payload["trained_on"]
        return model


def errors(predicted: Sequence[float], actual: Sequence[float]) -> dict[str, float]:
    """Mean absolute error and mean absolute percentage error (of the slowdown, in %)."""
    if len(predicted) != len(actual) or not actual:
        raise ValueError("need as many predictions as actual values, and at least one")
    ae = [abs(p - a) for p, a in zip(predicted, actual)]
    return {"mae": statistics.fmean(ae), "mape_pct": 100 * statistics.fmean(e / a for e, a in zip(ae, actual)),
            "n": len(actual)}
