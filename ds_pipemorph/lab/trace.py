"""A rate trace: the rate of one shaped pair over time, as points ``[{t: seconds, rate: 100mbit}]``
in a YAML or JSON file, played back with ``tc class change`` while a job runs."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..fileio import check_ordered, first_line, load_model


class RatePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    t: float = Field(ge=0, description="seconds after the trace starts")
    rate: Union[str, int] = Field(description="rate from then on: 100mbit, 1gbit, or bit/s")

    @field_validator("rate")
    @classmethod
    def _rate(cls, v):
        from ds_pipemorph.lab.shape import parse_rate

        parse_rate(v)
        return v

    @property
    def bits(self) -> int:
        from ds_pipemorph.lab.shape import parse_rate

        return parse_rate(self.rate)


class RateTrace(BaseModel):
    model_config = ConfigDict(extra="forbid")
    points: list[RatePoint] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _ordered(cls, pts):
        check_ordered([p.t for p in pts], "times", unit=" s")
        return pts


def load_rate_trace(path: str) -> RateTrace:
    return load_model(path, RateTrace)


class TraceFailed(RuntimeError):
    """Applying a point of a rate trace failed; the trace stopped there (the cause is chained)."""


class TracePlayer:
    """Calls ``apply(rate_bits)`` at each point's time on a thread; ``stop()`` ends it early.

    Should ``apply`` raise, the trace stops at that point and the next ``join()`` or ``stop()``
    raises ``TraceFailed`` (once) from the error: a failed trace is never silent."""

    def __init__(self, trace: RateTrace, apply: Callable[[int], None]):
        self.trace, self.apply = trace, apply
        self._stop = threading.Event()
        self.applied: list[tuple[float, int]] = []  # (seconds after start, rate) as applied
        self.error: Optional[TraceFailed] = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, name="lab-rate-trace", daemon=True)

    def start(self) -> "TracePlayer":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        for p in self.trace.points:
            if self._stop.wait(max(0.0, self._t0 + p.t - time.monotonic())):
                return
            try:
                self.apply(p.bits)
            except Exception as e:  # noqa: BLE001 - handed to the thread that joins
                failed = TraceFailed(f"the rate trace stopped at its point t={p.t:g} s: {first_line(e)}")
                failed.__cause__ = e
                self.error = failed
                return
            self.applied.append((time.monotonic() - self._t0, p.bits))

    def stop(self) -> None:
        self._stop.set()
        self.join()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the trace to end (at most ``timeout`` s); raise ``TraceFailed`` if it failed."""
        self._thread.join(timeout)
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error
