"""The control loop's measurements, smoothed, as the profile file of docs/design.md (``pipemorph plan`` input).

Every iteration the adapter feeds what all ranks measured (per stage the F, B and W times, per link
the one-way delay). Smoothing is a running median: over the last ``OP_WINDOW`` iterations for op
times (they drift slowly) and over the last ``LINK_WINDOW`` for link delays, short enough that a
profile written at a re-plan (two slow iterations, the detector's hysteresis) already shows the
slow link, and one odd value (a hiccup of a loaded host) never does. The file is validated by the
``Profile`` model before it is written, and written atomically.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Optional, Sequence

from ..fileio import dump, write_atomic
from ..plan.ir.ops import KINDS, Kind
from ..plan.ir.profile import Profile, memory_in_mb

OP_WINDOW = 5
LINK_WINDOW = 3




class ProfileExport:
    """Running medians of per-stage op times and per-link delays; ``profile()`` / ``write(path)``."""

    def __init__(self, stages: int, microbatches: int, caps: Optional[Sequence[int]] = None):
        self.S, self.N = stages, microbatches
        self.caps = list(caps) if caps is not None else None
        self._ops = {k: [deque(maxlen=OP_WINDOW) for _ in range(stages)] for k in KINDS}
        self._links = [deque(maxlen=LINK_WINDOW) for _ in range(stages - 1)]
        self.iterations = 0
        self._memory: Optional[dict] = None  # the bytes form of ``memory``, once measured

    def set_memory(self, f_bytes: Sequence[int], w_bytes: Sequence[int], units: Optional[Sequence[float]]) -> None:
        """What the first iteration measured (per stage: F's and W's saved bytes per micro-batch) and
        the budget in micro-batches (None: the caps): the profile's ``memory`` in MB from now on."""
        if not all(f > 0 for f in f_bytes):
            return  # a stage that saves nothing for B has no bytes form
        room = units if units is not None else self.caps or [self.N] * self.S
        self._memory = memory_in_mb(f_bytes, w_bytes, room)

    def add(self, f: Sequence[float], b: Sequence[float], w: Sequence[float],
            links: Sequence[Optional[float]]) -> None:
        """One iteration: op times per stage in ms (negative: not seen) and delay per link (None: not seen)."""
        for kind, vals in zip(KINDS, (f, b, w)):
            for s, v in enumerate(vals):
                if v >= 0:
                    self._ops[kind][s].append(float(v))
        for i, d in enumerate(links):
            if d is not None:
                self._links[i].append(float(d))
        self.iterations += 1

    def ready(self) -> bool:
        """Whether every stage has a time for each of F, B and W."""
        return all(q for qs in self._ops.values() for q in qs)

    def profile(self) -> Profile:
        """The smoothed measurements as a validated ``Profile`` (raises ValueError before any measurement)."""
        if not self.ready():
            raise ValueError("no op of some stage was measured yet: nothing to export")

        def med(q) -> float:
            return round(statistics.median(q), 2)

        data = {
            "stages": self.S,
            "microbatches": self.N,
            "compute_ms": {"forward": [med(q) for q in self._ops[Kind.F]],
                           "backward_input": [med(q) for q in self._ops[Kind.B]],
                           "backward_weight": [med(q) for q in self._ops[Kind.W]]},
            "links_ms": [med(q) if q else 0.0 for q in self._links],
        }
        if self._memory is not None:
            data["memory"] = dict(self._memory)
        elif self.caps is not None:
            data["memory"] = {"max_inflight": list(self.caps)}
        return Profile.model_validate(data)

    def write(self, path: str, note: str = "") -> None:
        """Write the profile as YAML, atomically (readers see the previous file or this one)."""
        body = dump(self.profile().model_dump(exclude_none=True), as_json=False)
        head = f"# measured by the pipemorph control loop{': ' + note if note else ''}\n"
        write_atomic(path, head + body)
