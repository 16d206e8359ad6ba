"""Per-op NVTX ranges (domain "pipemorph") and start/end times on the monotonic clock.

``OpRecorder.run(name, fn, *args)`` wraps one instruction: an NVTX range named like the op (``F3``,
``SEND_B3``) and an ``OpRecord`` appended to ``records``; ``OpRecorder.iteration()`` wraps one
``train_batch`` in a range ``ITER<k>``. The ranges follow the contract that
``ds_pipemorph.trace.nsys`` documents and reads (category ``stage<S>``; payload: the micro-batch
on an op, the global rank on ``ITER<k>``). They go through the ``nvtx`` package (never
``torch.cuda.nvtx``, which raises on CPU builds); with no profiler attached the package hands out
a disabled domain and the recorder skips NVTX altogether. Per op text the range's attributes are
built once and reused. The profiler and the Chrome timeline read the records.
"""
from __future__ import annotations

import contextlib
import functools
import re
import time
from typing import Callable, Iterator, NamedTuple, Optional

from ..plan.ir.ops import KINDS, Op, recorded_op

DOMAIN = "pipemorph"
_LOAD = re.compile(r"^LOAD(\d+)$")  # the one micro-batch instruction that is no plan op


class OpRecord(NamedTuple):
    op: str  # "F3", "B3", "W3", "SEND_F3", "RECV_B3", "OptimizerStep", ...
    start_ns: int  # time.monotonic_ns(): one clock for all processes of a machine
    end_ns: int

    @property
    def plan_op(self) -> Optional[Op]:
        """The plan op this record is of (``Op(Kind.F, 3)``), None for other instructions."""
        return recorded_op(self.op)


_started: list[Optional[float]] = [None]  # perf_counter() when the running instruction began


def take_instruction_start() -> Optional[float]:
    """When the running instruction began (``time.perf_counter()``), once; None outside one.

    An emulated op anchors its fixed duration there (``inject.emulated``), so that the engine's
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
    """``stage`` and ``rank`` (the global rank) go into the NVTX ranges. ``event_factory`` (on a GPU:
    ``lambda: torch.cuda.Event(enable_timing=True)``) times the compute ops F, B and W on the device
    as well: the host clock only sees kernel launches there. ``device_ms()`` then gives their device
    durations (it waits for the last event)."""

    def __init__(self, nvtx_enabled: bool, event_factory: Optional[Callable[[], object]] = None,
                 stage: int = 0, rank: int = 0):
        self.records: list[OpRecord] = []
        self._events: list[tuple[str, object, object]] = []
        self._event = event_factory
        self._category = f"stage{stage}"
        self._rank = rank
        self._iteration = 0  # k of the next ITER<k> range: train_batch calls so far
        self._domain = None  # an nvtx.Domain while a tool listens, else None
        self._attrs: dict[str, object] = {}  # op text -> its EventAttributes, built on first use
        if nvtx_enabled:
            import nvtx

            domain = nvtx.get_domain(DOMAIN)
            if isinstance(domain, nvtx.Domain):  # not the package's no-op domain: a tool is attached
                self._domain = domain

    @property
    def nvtx_active(self) -> bool:
        """True when ranges are emitted: ``nvtx`` enabled in the config and a tool attached."""
        return self._domain is not None

    def _attributes(self, name: str):
        op = recorded_op(name)
        m = None if op is not None else _LOAD.match(name)
        attrs = self._domain.get_event_attributes(message=name, category=self._category,
                                                  payload=op.mb if op else int(m.group(1)) if m else None)
        self._attrs[name] = attrs
        return attrs

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """One NVTX range ``ITER<k>`` (category ``stage<S>``, payload: the global rank) around a batch."""
        k, self._iteration = self._iteration, self._iteration + 1
        if self._domain is None:
            yield
            return
        self._domain.push_range(self._domain.get_event_attributes(
            message=f"ITER{k}", category=self._category, payload=self._rank))
        try:
            yield
        finally:
            self._domain.pop_range()

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
        if self._event is not None and (op := recorded_op(name)) is not None and op.kind.is_compute:
            pair = (self._event(), self._event())
            pair[0].record()
        domain = self._domain
        if domain is not None:
            attrs = self._attrs.get(name)
            if attrs is None:
                attrs = self._attributes(name)
        t0 = time.monotonic_ns()
        _started[0] = time.perf_counter()
        try:
            if domain is None:
                fn(*args, **kwargs)
            else:  # the range lies inside [t0, end] of the record
                domain.push_range(attrs)
                try:
                    fn(*args, **kwargs)
                finally:
                    domain.pop_range()
        finally:
            _started[0] = None
        self.records.append(OpRecord(name, t0, time.monotonic_ns()))
        if pair is not None:
            pair[1].record()
            self._events.append((name, *pair))

    def run_on_thread(self, name: str, fn: Callable[[], object]):
        """``fn()`` inside an NVTX range ``name`` on the calling thread (ready dispatch's receive
        threads), recorded as one OpRecord when it returns; its result."""
        domain = self._domain
        t0 = time.monotonic_ns()
        if domain is None:
            out = fn()
        else:
            domain.push_range(self._attrs.get(name) or self._attributes(name))
            try:
                out = fn()
            finally:
                domain.pop_range()
        self.records.append(OpRecord(name, t0, time.monotonic_ns()))  # list.append: atomic
        return out


def fbw_ms_per_microbatch(records, microbatches: int) -> list[float]:
    """Mean ms per micro-batch of the F, B and W among ``records`` (one stage's iteration)."""
    total = dict.fromkeys(KINDS, 0)
    for r in records:
        op = recorded_op(r.op)
        if op is not None and op.kind in total:
            total[op.kind] += r.end_ns - r.start_ns
    return [total[k] / 1e6 / microbatches for k in KINDS]
