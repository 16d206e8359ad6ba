"""Per-op NVTX ranges (domain "pipemorph") and start/end times on the monotonic clock.

``OpRecorder.run(name, fn, *args)`` wraps one instruction: an NVTX range named like the op (``F3``,
``SEND_B3``) when enabled (the ``nvtx`` package: < 1 µs with no profiler attached; never
``torch.cuda.nvtx``, which raises on CPU builds), and an ``OpRecord`` appended to ``records``.
The profiler and the Chrome timeline of later issues read these records.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple, Optional

DOMAIN = "pipemorph"


class OpRecord(NamedTuple):
    op: str  # "F3", "B3", "W3", "SEND_F3", "RECV_B3", "OptimizerStep", ...
    start_ns: int  # time.monotonic_ns(): one clock for all processes of a machine
    end_ns: int


_started: list[Optional[float]] = [None]  # perf_counter() when the running instruction began


def take_instruction_start() -> Optional[float]:
    """When the running instruction began (``time.perf_counter()``), once; None outside one.

    An emulated op anchors its fixed duration there (``runtime.emulated``), so that the engine's
    own work inside the instruction overlaps the op's time, as CPU work overlaps the kernels it
    launched on a GPU. Taken once: a second emulated op of the same instruction starts on its own.
    """
    t, _started[0] = _started[0], None
    return t


def as_instruction(fn: Callable) -> Callable:
    """Wrap an engine handler (e.g. stock DeepSpeed's) so that it publishes its start the same way."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _started[0] = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _started[0] = None
    return run


class OpRecorder:
    """``event_factory`` (on a GPU: ``lambda: torch.cuda.Event(enable_timing=True)``) times the compute
    ops F, B and W on the device as well: the host clock only sees kernel launches there.
    ``device_ms()`` then gives their device durations (it waits for the last event)."""

    def __init__(self, nvtx_enabled: bool, event_factory: Optional[Callable[[], object]] = None):
        self.records: list[OpRecord] = []
        self._events: list[tuple[str, object, object]] = []
        self._event = event_factory
        self._nvtx = None
        if nvtx_enabled:
            import nvtx

            self._nvtx = nvtx

    def reset(self) -> None:
        self.records = []
        self._events = []

    def device_ms(self) -> Optional[dict[str, float]]:
        """Op name -> device time in ms of the last batch's F, B and W (None without an event factory)."""
        if self._event is None:
            return None
        if self._events:
            self._events[-1][2].synchronize()
        return {name: start.elapsed_time(end) for name, start, end in self._events}

    def run(self, name: str, fn: Callable[..., object], *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` inside an NVTX range ``name``, recorded as one OpRecord."""
        pair = None
        if self._event is not None and name[:1] in "FBW" and name[1:].isdigit():
            pair = (self._event(), self._event())
            pair[0].record()
        t0 = time.monotonic_ns()
        _started[0] = time.perf_counter()
        try:
            if self._nvtx is None:
                fn(*args, **kwargs)
            else:
                with self._nvtx.annotate(message=name, domain=DOMAIN):
                    fn(*args, **kwargs)
        finally:
            _started[0] = None
        self.records.append(OpRecord(name, t0, time.monotonic_ns()))
        if pair is not None:
            pair[1].record()
            self._events.append((name, *pair))
