"""``build_transport``: one transport per rank that routes each link direction to ``direct`` or ``delegated``.

``LinkRouter`` (a ``protocol.Transport`` and ``protocol.LinkControl``) owns a direct path
(``DirectTransport``, wrapped by the plug-ins' ``runtime.hooks.TransportHooks``: injected faults and
delays) and a ``DelegatedTransport`` whose delegates start only for the links that use it (the hooks'
``DelaySource`` is applied inside its sender delegates). Modes
are kept per link direction ("F" and "B" of a link) so that a failure of one direction moves only that
direction; ``set_link_mode`` moves both directions of a link at an iteration boundary.

Failover (PipeMorph §5.3): a ``TransportError`` from the direct path of a direction that is not a
timeout moves that direction to the delegated path for the failed message and every later one, on
both ends (each end sees its own error for the same message: the fault is a property of the link),
and logs one line naming the link. A direct path fails too when the peer rank's process is gone:
before failing over, the router asks this process's lifeline (``runtime.lifeline.peer_gone``) for a
second opinion, and a peer that died ends the job with a sentence naming it instead (moving the link
to delegates would only wait for a peer that is not there). A failed direction stays delegated (``set_link_mode`` does not
move it back). On a delayed link the real send happens later, in the delay's delivery thread: a
failure there (``protocol.DeliveryError``) is failed over from that thread at once, re-sending the
undelivered message through the delegates before any later one (the peer may be blocked on it while
this rank waits for the peer), and surfaces again at the next call, where it is already handled.
The router's lock orders that thread's re-send against the training thread's later sends.

Config semantics: ``delegation.mode`` "off" = every link direct; "always" = every link delegated;
"auto" = the caller's ``link_mode`` (the control plane's decision), every other link direct. Injected
delays never choose the path by themselves (the detector, not the test harness, decides in "auto").
Under "auto" the fork server the delegates come from starts only when a link may need it (``prewarm``,
at the control loop's first slow observation; or the first delegated link or failover), so a job
whose links stay direct runs nothing beside training.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from ...plan.ir.links import Route
from ...plan.ir.ops import PAYLOADS, Kind, message_op
from .. import hooks as plugins
from .delegated.transport import DelegatedTransport
from .direct import DirectTransport, EarlierSendFailed
from .protocol import (DeferredSends, DeliveryError, TransportError, TransportTimeout, directions_on, link_of,
                       peer_of)

log = logging.getLogger("ds_pipemorph.transports")

MODES = tuple(Route)  # the paths a link direction can take


class LinkRouter:
    """A ``Transport`` and ``LinkControl``; each (link, kind) goes through its current path."""

    def __init__(self, rank: int, stage_id: int, direct, delegated: DelegatedTransport,
                 link_mode: dict[int, Route], failover: bool = True, delays: plugins.DelaySource | None = None):
        self.rank, self.stage_id = rank, stage_id
        self.direct, self.delegated = direct, delegated
        self.failover = failover
        self.events: list[str] = []
        self._mode: dict[tuple[int, Kind], Route] = {}
        self._failed: set[tuple[int, Kind]] = set()  # directions whose direct path failed: delegated for good
        self._links = {(kind, sending): link_of(stage_id, kind, sending)  # (kind, sending) -> link
                       for kind in PAYLOADS for sending in (True, False)}
        self._lock = threading.RLock()
        self._delays = delays  # injected: started at the first message (a trace's t = 0)
        if failover and isinstance(direct, DeferredSends):
            direct.on_failure = self._recover
        for link, mode in link_mode.items():
            self.set_link_mode(link, mode)

    def link_mode(self, link: int, kind: Kind = Kind.F) -> Route:
        return self._mode.get((link, kind), Route.DIRECT)

    def set_link_mode(self, link: int, mode: Route, queues: int | None = None) -> None:
        """Move both directions of ``link`` to ``mode`` (call on both ends, at the same iteration boundary,
        after ``wait_sends``: every earlier message is then held by its receiver, so none is lost or reordered).
        ``queues``: delegate FIFOs per direction of a delegated link (grows a running link's, never shrinks)."""
        if mode not in MODES:
            raise ValueError(f"rank {self.rank}: link {link} mode must be one of {tuple(map(str, MODES))}, not '{mode}'")
        mode = Route(mode)  # a route given as its text ("direct") is the route
        if link < 0 or not directions_on(self.stage_id, link):
            return  # not an end of this link: nothing to route
        if mode is Route.DELEGATED:
            self.delegated.start_link(link, queues)
        with self._lock:
            for kind in PAYLOADS:
                if (link, kind) not in self._failed:
                    self._mode[(link, kind)] = mode

    def add_hooks(self, hooks: plugins.TransportHooks, timeout_s: float) -> None:
        """Put transport hooks on this running router as ``build_transport`` puts them on a new one (tests
        and benchmarks that change injected conditions while training): its direct path is wrapped, and
        the hooks' delay source, if any, becomes the one both paths read. Call it on both ends of every
        link between iterations, after ``wait_sends``. ``wrap_router`` is not applied: the caller holds
        this router."""
        with self._lock:
            self.direct = hooks.wrap_direct(self.direct, rank=self.rank, stage_id=self.stage_id, timeout_s=timeout_s)
            if hooks.delays is not None:
                self._delays = self.delegated.delays = hooks.delays
            if self.failover and isinstance(self.direct, DeferredSends):
                self.direct.on_failure = self._recover

    def queues_of(self, link: int) -> int:
        return self.delegated.queues_of(link)

    def prewarm(self) -> None:
        self.delegated.prewarm()

    def delegate_pid(self, link: int, kind: Kind, sending: bool, queue: int) -> int:
        return self.delegated.delegate_pid(link, kind, sending, queue)

    def _path(self, kind: Kind, sending: bool):
        if self._delays is not None:
            self._delays.start()
        with self._lock:  # orders a delivery thread's failover re-send before this rank's later sends
            mode = self._mode.get((self._links[kind, sending], kind), Route.DIRECT)
        return self.delegated if mode is Route.DELEGATED else self.direct

    def _fail_over(self, kind: Kind, sending: bool, mb: int, err: TransportError) -> None:
        link = link_of(self.stage_id, kind, sending)
        with self._lock:
            if (link, kind) in self._failed:
                return
            line = (f"rank {self.rank}: link {link} direct path failed at {message_op(kind, mb, sending)} "
                    f"({err}); this and every later {kind} message of link {link} go through the delegates")
            self.events.append(line)
            log.warning(line)
            self._mode[(link, kind)] = Route.DELEGATED
            self._failed.add((link, kind))

    def _recover(self, err: DeliveryError) -> None:
        """Fail over the direction of a message whose delayed delivery failed and re-send it through the
        delegates, once (from the delivery thread, or at the next call if that did not happen)."""
        kind, mb, payload = err.message
        with self._lock:
            if err.recovered:
                return
            self._refuse_for_dead_peer(kind, True, err)
            # Sent before the direction moves: if this send fails, later messages still meet this error
            # on the direct path and retry it first, so the order holds.
            self.delegated.send(kind, mb, payload)
            self._fail_over(kind, True, mb, err)
            err.recovered = True

    def _failing_over(self, err: TransportError, kind: Kind, sending: bool) -> bool:
        if not self.failover or isinstance(err, TransportTimeout):
            return False
        self._refuse_for_dead_peer(kind, sending, err)
        return True

    def _refuse_for_dead_peer(self, kind: Kind, sending: bool, err: TransportError) -> None:
        """A direct path that failed because the peer rank died is no link to fail over."""
        from .. import lifeline

        life = lifeline.current()
        ranks = getattr(self.delegated, "stage_ranks", None)
        if life is None or not ranks:
            return
        stage = peer_of(self.stage_id, kind, sending)
        if life.peer_gone(ranks[stage]):
            raise TransportError(f"rank {self.rank}: rank {ranks[stage]} (stage {stage}) died: its process is gone "
                                 f"({err})") from err

    def post_recv(self, kind: Kind, mb: int) -> None:
        self._path(kind, False).post_recv(kind, mb)

    def send(self, kind: Kind, mb: int, payload) -> None:
        path = self._path(kind, True)
        if path is self.delegated:
            return path.send(kind, mb, payload)
        try:
            path.send(kind, mb, payload)
        except TransportError as e:
            if isinstance(e, EarlierSendFailed) or not self._failing_over(e, kind, True):
                raise
            if isinstance(e, DeliveryError):  # an earlier message of this direction: it goes first
                self._recover(e)
            else:
                self._fail_over(kind, True, mb, e)
            self.delegated.send(kind, mb, payload)

    def recv(self, kind: Kind, mb: int):
        path = self._path(kind, False)
        if path is self.delegated:
            return path.recv(kind, mb)
        try:
            return path.recv(kind, mb)
        except TransportError as e:
            if not self._failing_over(e, kind, False):
                raise
            self._fail_over(kind, False, mb, e)
            return self.delegated.recv(kind, mb)

    def wait_sends(self) -> None:
        while True:  # each failed delivery is raised once; the other lanes are waited for on the next pass
            try:
                self.direct.wait_sends()
                break
            except DeliveryError as e:
                if not self.failover:
                    raise
                self._recover(e)
        self.delegated.wait_sends()

    def begin_group(self) -> None:
        self.direct.begin_group()  # only the direct path groups (the delegates' FIFOs need none)

    def end_group(self) -> None:
        self.direct.end_group()

    def reset_shapes(self) -> None:
        self.direct.reset_shapes()
        self.delegated.reset_shapes()

    def close(self) -> None:
        try:
            self.direct.close()
        finally:
            self.delegated.close()


def build_transport(cfg, rank: int, stage_id: int, stage_ranks: Sequence[int], device: torch.device | None,
                    link_mode: dict[int, Route] | None = None, static_shapes: bool = True,
                    hooks: Sequence[plugins.TransportHooks] | None = None, **delegated_kw):
    """A ``LinkRouter`` for ``cfg`` (a ``PipeMorphConfig``): see the module docstring for the modes.

    ``hooks`` (``runtime.hooks.TransportHooks``, applied in order; default: what the registered plug-ins
    give for ``cfg``, e.g. its ``inject`` section) wrap the direct path and the router and hand the
    delegated path its injected delays (testing only).
    ``delegated_kw`` go to ``DelegatedTransport`` (slot_bytes, num_slots, session, ...).
    """
    links = len(stage_ranks) - 1
    timeout = float(cfg.timeout_s)
    if hooks is None:
        hooks = plugins.transport_hooks(cfg, len(stage_ranks))
    direct = DirectTransport(rank, stage_id, stage_ranks, timeout_s=timeout, device=device, static_shapes=static_shapes,
                             send_window=cfg.send_window_in_force)
    delays = None
    for h in hooks:
        direct = h.wrap_direct(direct, rank=rank, stage_id=stage_id, timeout_s=timeout)
        delays = delays if h.delays is None else h.delays
    delegated = DelegatedTransport(rank, stage_id, stage_ranks, timeout_s=timeout, device=device,
                                   queues=cfg.delegation.queues, max_queues=cfg.delegation.queue_cap, delays=delays,
                                   interfaces=cfg.delegation.interfaces, fit_ring=cfg.send_window_in_force is not None,
                                   **{"slot_bytes": cfg.delegation.slot_mb << 20, "num_slots": cfg.delegation.slots,
                                      **delegated_kw})
    mode = cfg.delegation.mode
    asked = {i: Route(m) for i, m in (link_mode or {}).items()}
    if mode == "off":
        if Route.DELEGATED in asked.values():
            raise ValueError("delegation.mode 'off' refuses delegated links; use 'auto' or 'always'")
        modes = {}
    elif mode == "always":
        modes = dict.fromkeys(range(links), Route.DELEGATED)
    else:
        modes = asked
    router = LinkRouter(rank, stage_id, direct, delegated, modes, delays=delays)
    if mode != "off":  # the op now; the fork server too if a link starts delegated, else when one may need it
        delegated.prepare(start_server=Route.DELEGATED in modes.values())
    for h in hooks:
        router = h.wrap_router(router)
    return router
