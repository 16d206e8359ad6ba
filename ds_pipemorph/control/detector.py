"""Per-link straggler detector with hysteresis (PipeMorph §6, without an oracle).

Each iteration the runtime reports the measured one-way delay of every link (the median over that
iteration's messages). The detector compares it with what the current plan tolerates:

* up: a link whose delay exceeds the plan's tolerance (and the noise floor) by more than
  ``up_margin`` of it for ``up_iterations`` iterations in a row gets a new target delay, rounded up
  to ``quantum_ms``; the margin keeps a link that jitters around its planned delay (40.6 ms, then
  41.6 ms on a plan for 41) from being re-planned for every millisecond;
* down: a link planned for a delay whose measured delay stays below ``recover_ratio`` of it for
  ``down_iterations`` iterations in a row gets the measured delay as its target (0 below the floor),
  which returns the pipeline to the no-delay plan once the link has recovered.

``observe`` returns the new per-link target delays when a re-plan is due, else None; after the
caller re-planned it calls ``adopt`` with the new plan's targets and per-link tolerance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DetectorConfig:
    floor_ms: float = 5.0  # measured delays below this are noise (jitter of a loaded host, serialisation)
    up_iterations: int = 2  # a single slow iteration (a hiccup) does not change the plan
    down_iterations: int = 2
    recover_ratio: float = 0.5
    # Targets round up to this: coarse steps plan for more delay than measured (35 ms for 30.2 cost ~3 %
    # of the iteration at 4 x 12); jitter is held off by up_iterations and the plan's tolerance instead.
    quantum_ms: float = 1.0
    # A delay this share above what the plan in force absorbs is jitter, not a slower link: beyond
    # the tolerance each extra ms costs at most about a ms per slow hop, while a re-plan costs a
    # search and a switch of every rank.
    up_margin: float = 0.05

    def __post_init__(self):
        if self.floor_ms < 0 or self.quantum_ms <= 0 or self.up_margin < 0:
            raise ValueError("floor_ms must be >= 0, quantum_ms > 0 and up_margin >= 0")
        if self.up_iterations < 1 or self.down_iterations < 1:
            raise ValueError("up_iterations and down_iterations must be >= 1")
        if not 0 < self.recover_ratio < 1:
            raise ValueError("recover_ratio must be between 0 and 1")


class LinkDetector:
    def __init__(self, links: int, config: DetectorConfig = DetectorConfig()):
        self.cfg = config
        self.planned_for = [0.0] * links
        self.tolerance = [0.0] * links
        self._up = [0] * links
        self._down = [0] * links
        self.replans = 0

    def adopt(self, planned_for: list[float], tolerance: list[float]) -> None:
        """The plan now in force: the delays it was made for and what it absorbs per link."""
        self.planned_for = list(planned_for)
        self.tolerance = list(tolerance)
        self._up = [0] * len(planned_for)
        self._down = [0] * len(planned_for)

    @property
    def settled(self) -> bool:
        """No link counts slow or recovered iterations towards a new target: the next observation
        may come later without splitting a run of iterations the counts need in a row."""
        return not any(self._up) and not any(self._down)

    @property
    def rising(self) -> list[int]:
        """Links counting slow iterations towards a higher target (a re-plan may follow in ``patience``)."""
        return [i for i, n in enumerate(self._up) if n]

    def observe(self, measured_ms: list[Optional[float]]) -> Optional[list[float]]:
        """Feed one iteration's measured delay per link (None: no message seen)."""
        cfg = self.cfg
        target = list(self.planned_for)
        for i, d in enumerate(measured_ms):
            if d is None:
                continue
            if d > max(cfg.floor_ms, (1 + cfg.up_margin) * max(self.tolerance[i], self.planned_for[i])):
                self._up[i] += 1
            else:
                self._up[i] = 0
            low = self.planned_for[i] > 0 and d < self.planned_for[i] * cfg.recover_ratio
            self._down[i] = self._down[i] + 1 if low else 0
            if self._up[i] >= cfg.up_iterations:
                target[i] = self._quantize_up(d)
            elif self._down[i] >= cfg.down_iterations:
                target[i] = 0.0 if d < cfg.floor_ms else self._quantize_up(d)
        if target != self.planned_for:
            self.replans += 1
            return target
        return None

    def _quantize_up(self, d: float) -> float:
        q = self.cfg.quantum_ms
        return math.ceil(d / q - 1e-9) * q
