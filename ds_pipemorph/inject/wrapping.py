"""Explicit forwarding bases for wrappers around a transport or a link router (test doubles).

A wrapper changes a few operations (delays a send, fails a receive, kills a delegate after a send)
and hands everything else to the object it wraps. These bases spell each forwarded operation out, so
that a wrapper satisfies ``protocol.Transport`` (and ``protocol.LinkControl`` for a router) by its
methods, not by attribute look-up falling through to the wrapped object.
"""
from __future__ import annotations

from typing import Optional

from ..plan.ir.links import Route
from ..plan.ir.ops import Kind
from ..runtime.transport.protocol import LinkControl, Payload, Transport, sender_waits_on


class TransportWrapper:
    """A ``Transport`` that forwards every operation to ``inner``; subclasses override what they change."""

    def __init__(self, inner: Transport):
        self.inner = inner

    @property
    def sender_waits(self) -> bool:
        """Whether a send holds the training process on a slow link (``DirectTransport.sender_waits``)."""
        return getattr(self.inner, "sender_waits", True)

    def sender_waits_on(self, link: int) -> bool:
        """Whether a send on ``link`` holds the training process (``DirectTransport.sender_waits_on``)."""
        return self.inner_waits_on(link)

    def inner_waits_on(self, link: int) -> bool:
        """The wrapped path's ``sender_waits_on``, or its ``sender_waits`` for every link."""
        return sender_waits_on(self.inner, link)

    def post_recv(self, kind: Kind, mb: int) -> None:
        self.inner.post_recv(kind, mb)

    def send(self, kind: Kind, mb: int, payload: Payload) -> None:
        self.inner.send(kind, mb, payload)

    def recv(self, kind: Kind, mb: int) -> Payload:
        return self.inner.recv(kind, mb)

    def wait_sends(self) -> None:
        self.inner.wait_sends()

    def begin_group(self) -> None:
        self.inner.begin_group()

    def end_group(self) -> None:
        self.inner.end_group()

    def reset_shapes(self) -> None:
        self.inner.reset_shapes()

    def close(self) -> None:
        self.inner.close()


class RouterWrapper(TransportWrapper):
    """A ``Transport`` and ``LinkControl`` that forwards everything to a link router ``inner``, including
    the router's paths (``direct``, ``delegated``), its ``events`` and which stage it serves."""

    inner: LinkControl

    @property
    def events(self) -> list:
        return self.inner.events

    @property
    def direct(self):
        return self.inner.direct

    @property
    def delegated(self):
        return self.inner.delegated

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def stage_id(self) -> int:
        return self.inner.stage_id

    def link_mode(self, link: int, kind: Kind = Kind.F) -> Route:
        return self.inner.link_mode(link, kind)

    def set_link_mode(self, link: int, mode: Route, queues: Optional[int] = None) -> None:
        self.inner.set_link_mode(link, mode, queues)

    def queues_of(self, link: int) -> int:
        return self.inner.queues_of(link)

    def delegate_pid(self, link: int, kind: Kind, sending: bool, queue: int) -> int:
        return self.inner.delegate_pid(link, kind, sending, queue)

    def prewarm(self) -> None:
        self.inner.prewarm()
