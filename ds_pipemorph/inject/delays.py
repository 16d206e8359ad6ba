"""Delay injection as a transport wrapper (testing only; never read by the detector or planner).

docs/design.md's model of a slow link: a FIFO with one message in flight; each message takes the link's
delay c before the receiver can see it. On the ``direct`` path the training process blocks when it
sends into a full FIFO (head-of-line blocking, as a saturated NCCL queue blocks the next kernel).
A ``Lane`` is that FIFO: a thread that holds one message for c ms and then hands it to the real
send. Delays are static per link or replayed from a trace in wall-clock time.

``DelaySchedule`` is the ``runtime.hooks.DelaySource`` the delegated path receives: its sender
delegates apply the same delays, and a ``DelayTraceFile`` travels to them by pickling.

When the real send fails in the lane's thread, the message was not delivered: ``DelayInjector``
(a ``protocol.DeferredSends``) hands a ``DeliveryError`` (a ``TransportError`` carrying that message)
to its ``on_failure`` hook at once (the router fails the link over and re-sends the message there, so
the peer waiting for it is not stuck), and raises it again at its next ``send`` or ``wait_sends`` on
that link.
"""
from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..fileio import BadInput, load_model
from ..plan.ir.ops import message_op
from ..plan.sim.variation import LinkTraceFile
from ..runtime.hooks import TransportHooks
from ..runtime.transport.protocol import DeliveryError, TransportError, TransportTimeout, link_of
from .wrapping import TransportWrapper


class DelayTraceFile(LinkTraceFile):
    """A delay trace file: ``points: [{t: 0.0, links_ms: [0, 0, 30]}, {t: 1.5, ...}]`` (the format of
    ``plan.sim.variation.LinkTraceFile``, which the simulator replays), looked up by time as it runs."""

    def check_links(self, links: int, source: str) -> None:
        for p in self.points:
            if len(p.links_ms) != links:
                raise BadInput(f"{source}: point t={p.t} has {len(p.links_ms)} delays, the job has {links} links")

    def at(self, t: float) -> list[float]:
        times = self.__dict__.get("_times")
        if times is None:  # once: a sender looks the delay up per message
            times = self.__dict__["_times"] = [p.t for p in self.points]
        i = bisect.bisect_right(times, t) - 1
        return list(self.points[max(i, 0)].links_ms)


def load_trace(path: str, links: int) -> DelayTraceFile:
    if not Path(path).is_file():
        raise BadInput(f"inject.trace: cannot read '{path}'")
    tr = load_model(path, DelayTraceFile)
    tr.check_links(links, f"inject.trace {path}")
    return tr


class DelaySchedule:
    """Current injected delay per link: static values, or a trace replayed from ``start()``.

    The trace's clock starts at the first ``start()`` or ``delay_ms()``: in training, the router's first
    message operation (the start of the rank's first iteration). Delegate processes read the origin
    and the static delays that their training process last published (``transport.delegated.delay_publishing``).
    """

    def __init__(self, static_ms: Sequence[float], trace: Optional[DelayTraceFile] = None):
        self.static = list(static_ms)
        self.trace = trace
        self._t0: Optional[float] = None

    @property
    def origin(self) -> Optional[float]:
        """The trace's t = 0 on ``time.monotonic`` (None until started)."""
        return self._t0

    def start(self) -> float:
        """Start the trace's clock now unless it runs already; returns its origin (``time.monotonic``)."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        return self._t0

    def may_delay(self, link: int) -> bool:
        """Whether ``link`` is ever delayed: its static delay, or any point of the trace."""
        if self.trace is None:
            return self.static[link] > 0
        return any(p.links_ms[link] > 0 for p in self.trace.points)

    def delay_ms(self, link: int) -> float:
        if self.trace is None:
            return self.static[link]
        return self.trace.at(time.monotonic() - self.start())[link]


class Lane:
    """One FIFO with one message in flight: ``submit`` hands a message that becomes visible c ms later.

    ``wait_free`` blocks until the message in flight (if any) has been delivered and returns the
    seconds spent waiting: that is the head-of-line blocking the sender experiences. An error of a
    delivery is raised by the next ``submit`` or ``wait_free``: a ``TransportError`` as it is, any
    other as a ``TransportError`` naming the lane.
    """

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._job: Optional[tuple[float, Callable[[], None]]] = None
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"pipemorph-lane-{name}", daemon=True)
        self._thread.start()

    def wait_free(self, timeout_s: float) -> float:
        t = time.monotonic()
        with self._cv:
            if not self._cv.wait_for(lambda: self._job is None, timeout=timeout_s):
                raise TransportTimeout(f"{self.name}: the message in flight was not delivered within {timeout_s:g} s")
            self._raise()
        return time.monotonic() - t

    def submit(self, delay_s: float, deliver: Callable[[], None]) -> None:
        with self._cv:
            self._raise()
            assert self._job is None, "submit on a busy lane: call wait_free first"
            self._job = (time.monotonic() + delay_s, deliver)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _raise(self) -> None:
        if self._error is None:
            return
        err, self._error = self._error, None
        if isinstance(err, TransportError):
            raise err
        raise TransportError(f"{self.name}: delivering a delayed message failed: {err}") from err

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._closed)
                if self._closed and self._job is None:
                    return
                due, deliver = self._job
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                deliver()
            except BaseException as e:  # handed to the training thread at its next call
                self._error = e
            with self._cv:
                self._job = None
                self._cv.notify_all()


class DelayInjector(TransportWrapper):
    """Wraps a transport and delays its sends (receives, ``reset_shapes`` go straight to it).

    Only sends are delayed (the receiver simply sees the message later). ``blocked_s[link]``
    accumulates the time the training process spent blocked on a full FIFO. ``on_failure``, if set,
    is called in the lane's thread with the ``DeliveryError`` of a message whose real send failed
    (see the module docstring); the error is raised again at the next call on that link all the same.
    """

    sender_waits = True  # a lane holds the training process while its one message is in flight

    def __init__(self, inner, stage_id: int, delays: DelaySchedule, timeout_s: float = 300.0,
                 on_failure: Optional[Callable[[DeliveryError], None]] = None):
        super().__init__(inner)
        self.stage_id = stage_id
        self.delays = delays
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.blocked_s: dict[int, float] = {}
        self.sent: dict[int, int] = {}
        self._lanes: dict[int, Lane] = {}

    def sender_waits_on(self, link: int) -> bool:
        """A link this injector delays blocks its sender (its lane); any other link's sends go to the
        wrapped path as they are and block only if that path's do."""
        return self.delays.may_delay(link) or link in self._lanes or self.inner_waits_on(link)

    def send(self, kind: str, mb: int, payload) -> None:
        link = link_of(self.stage_id, kind, sending=True)
        c = self.delays.delay_ms(link)
        if c <= 0 and link not in self._lanes:
            return self.inner.send(kind, mb, payload)
        lane = self._lanes.get(link)
        if lane is None:
            lane = self._lanes[link] = Lane(f"stage {self.stage_id} link {link}")
        self.blocked_s[link] = self.blocked_s.get(link, 0.0) + lane.wait_free(self.timeout_s)
        self.sent[link] = self.sent.get(link, 0) + 1
        lane.submit(c / 1000.0, lambda: self._deliver(kind, mb, payload))

    def _deliver(self, kind: str, mb: int, payload) -> None:
        """The real send, in the lane's thread; a failure becomes a ``DeliveryError`` holding the message."""
        try:
            self.inner.send(kind, mb, payload)
        except TransportTimeout:
            raise
        except Exception as e:  # whatever broke, the message was not delivered
            text = str(e) if isinstance(e, TransportError) else f"stage {self.stage_id}: {message_op(kind, mb, True)} failed: {e}"
            err = DeliveryError(f"{text} (in the delivery thread, after its injected delay)", kind, mb, payload)
            if self.on_failure is not None:
                try:
                    self.on_failure(err)
                except Exception as again:  # not recovered: the next call tries again (and raises if it fails)
                    raise err from again
            raise err from e

    def wait_sends(self) -> None:
        for lane in self._lanes.values():
            lane.wait_free(self.timeout_s)
        self.inner.wait_sends()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self.inner.close()


def delay_schedule(inject_cfg, stages: int) -> Optional[DelaySchedule]:
    """The ``pipemorph.inject`` section for a job of ``stages`` stages (None: nothing injected).

    Raises BadInput with one sentence for a link the job does not have or an unreadable trace.
    """
    links = stages - 1
    static = [0.0] * links
    for key, link_cfg in inject_cfg.links.items():
        i = int(key)
        if i >= links:
            raise BadInput(
                f"ds_config pipemorph.inject.links names link {i}, but a {stages}-stage pipeline has links 0..{links - 1}")
        static[i] = link_cfg.delay_ms
    trace = load_trace(inject_cfg.trace, links) if inject_cfg.trace else None
    if trace is None and not any(static):
        return None
    return DelaySchedule(static, trace)


class DelayHooks(TransportHooks):
    """Transport hooks that put ``delays`` on both paths: a ``DelayInjector`` around the direct path,
    and the schedule as the delegated path's delay source."""

    def __init__(self, delays: DelaySchedule):
        self.delays = delays

    def wrap_direct(self, direct, *, rank: int, stage_id: int, timeout_s: float):
        return DelayInjector(direct, stage_id, self.delays, timeout_s=timeout_s)


def install_delays(engine, delays: DelaySchedule, timeout_s: float = 60.0) -> DelayInjector:
    """Put ``delays`` on both paths of every link of a running ``PipeMorphEngine`` (tests and benchmarks
    that change delays while training; a job configures ``inject`` instead). The injected direct path
    blocks its sender, and the control loop is told so: its model of direct links becomes ``Direct()``.
    Call it on every rank (each plans from the same table with its own policy), on the engine's own
    router (not one wrapped by another test injector): it goes through the router's ``add_hooks``.
    Unlike a job's ``inject`` section, whose injector blocks only the links its schedule delays, every
    link is modelled as blocking here: ``delays`` may slow any link later."""
    from ..plan.ir.links import DIRECT

    engine.transport.add_hooks(DelayHooks(delays), timeout_s)
    if engine.adapter is not None:
        engine.adapter.policy.set_direct_model(DIRECT)
    return engine.transport.direct
