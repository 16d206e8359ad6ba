"""What every transport promises, the errors it raises, and which link a message takes.

The contract (``Transport``), for every transport of this package and every wrapper around one:

- A *message* is identified by ``(kind, mb)``: ``kind`` is ``"F"`` (an activation, sent by stage s to
  stage s+1) or ``"B"`` (an input gradient, sent by stage s to stage s-1); ``mb`` is the micro-batch
  index (an int >= 0), unique per kind within an iteration. The payload is a tensor or a tuple of
  tensors of any dtypes and shapes; the receiver gets the same structure, in freshly allocated
  tensors that share no buffer with the transport.
- Ordering: sends and receives match by ``(kind, mb)``, not by issue order, so a stage's op order never
  has to agree with its neighbour's.
- Blocking: ``send`` returns without waiting for the receiver unless the messages in flight are
  bounded and the bound is reached: it may wait while the link's queue is full, and on the direct path
  under ``send_window`` (gloo) for the oldest message of its kind to that peer to be received once the
  window is full; the caller must not change the payload until ``wait_sends`` returned. ``post_recv``
  announces a receive ahead of time and never blocks (calling it twice for one message is harmless;
  ``recv`` does not need it). ``recv`` blocks until the message is in.
  ``wait_sends`` blocks until the peers hold every message this rank sent so far (call it once per
  iteration, before anything that assumes delivery, such as switching a link's path).
- Timeouts: every wait on another process ends after the transport's ``timeout_s`` with
  ``TransportTimeout``, whose text names the rank, the op (e.g. ``RECV_F3``), the link and the peer.
- Errors: anything else that prevents a message from being sent or received as asked (the peer is gone,
  the link broke, a message's layout changed under static shapes) raises ``TransportError``, one sentence
  naming the rank and the op. ``reset_shapes`` forgets the message layouts learned so far (every rank
  at once, between iterations); ``close`` drops pending state without waiting (after an error or at
  shutdown).

``LinkControl`` is what the link router offers the control loop (and the fault injection): the path
of each link direction (``"direct"`` in the training process or ``"delegated"`` to delegate processes)
and the delegate queues behind it. ``DeferredSends`` marks a transport that performs its real sends
later in its own thread (delay injection): a failed delivery there is handed to ``on_failure`` as a
``DeliveryError`` carrying the undelivered message, so that the router can fail the link over at once.

``link_of`` is the one rule for which link a message uses; ``peer_of`` and ``directions_on`` follow from it.
This module imports no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union, runtime_checkable

from ...plan.ir.links import Route
from ...plan.ir.ops import PAYLOADS, Kind

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    Payload = Union[torch.Tensor, Sequence[torch.Tensor]]
else:
    Payload = Any

KIND_NAMES = PAYLOADS  # Kind.F: an activation (flows to the next stage); Kind.B: an input gradient (to the previous one)


class TransportError(RuntimeError):
    """A message that cannot be sent or received as asked (the peer is gone, the link broke)."""


class TransportTimeout(TransportError):
    """A wait on another process ran out of time."""


class DeliveryError(TransportError):
    """The real send of a deferred message failed in its delivery thread: ``message`` = (kind, mb, payload)
    was not delivered; ``recovered`` is set once it went through another path (the delegates)."""

    def __init__(self, text: str, kind: Kind, mb: int, payload):
        super().__init__(text)
        self.message = (kind, mb, payload)
        self.recovered = False


def _downstream(kind: Kind, sending: bool) -> bool:
    """True if the message travels from stage s to s+1 as seen from its sender or receiver."""
    if kind == Kind.F:
        return sending
    if kind == Kind.B:
        return not sending
    raise ValueError(f"message kind must be one of {tuple(map(str, KIND_NAMES))}, not {kind!r}")


def link_of(stage_id: int, kind: Kind, sending: bool) -> int:
    """The link (link i joins stage i and stage i+1) that stage ``stage_id`` sends (``sending``) or
    receives a ``kind`` message on: activations "F" flow s -> s+1 over link s, input gradients "B" flow
    s -> s-1 over link s-1; so a receiver of F on stage s uses link s-1 and a receiver of B link s."""
    return stage_id if _downstream(kind, sending) else stage_id - 1


def peer_of(stage_id: int, kind: Kind, sending: bool) -> int:
    """The stage at the other end of that link."""
    return stage_id + 1 if _downstream(kind, sending) else stage_id - 1


def directions_on(stage_id: int, link: int) -> tuple[tuple[str, bool], ...]:
    """The (kind, sending) directions stage ``stage_id`` uses on ``link`` (empty if it is not an end of it):
    on link s it sends F and receives B, on link s-1 it receives F and sends B."""
    return tuple((kind, sending) for kind in KIND_NAMES for sending in (True, False)
                 if link_of(stage_id, kind, sending) == link)


def sender_waits_on(path, link: int) -> bool:
    """Whether a send on ``link`` holds the training process on the direct path ``path``: its own
    ``sender_waits_on(link)`` where it answers per link (a delay injector blocks only the links it
    delays), else its ``sender_waits`` for every link (True when it does not say: NCCL's rule)."""
    per_link = getattr(path, "sender_waits_on", None)
    return bool(per_link(link)) if per_link is not None else bool(getattr(path, "sender_waits", True))


@runtime_checkable
class Transport(Protocol):
    """Messages between neighbouring stages; the contract is in this module's docstring."""

    def post_recv(self, kind: Kind, mb: int) -> None:
        """Announce the receive of message (kind, mb) ahead of time (idempotent, never blocks)."""

    def send(self, kind: Kind, mb: int, payload: Payload) -> None:
        """Post message (kind, mb); return without waiting for the receiver unless the messages in flight
        to that peer are bounded and the bound is reached (a full queue, ``send_window``)."""

    def recv(self, kind: Kind, mb: int) -> Payload:
        """Wait for message (kind, mb) and return it in fresh tensors."""

    def wait_sends(self) -> None:
        """Wait until the peers hold every message sent so far."""

    def begin_group(self) -> None:
        """Issue the sends and receives posted from here to ``end_group`` as one group where the wire
        groups them (NCCL: one ``batch_isend_irecv``); elsewhere this changes nothing."""

    def end_group(self) -> None:
        """Issue the group ``begin_group`` opened."""

    def reset_shapes(self) -> None:
        """Forget the message layouts learned so far (every rank at once, between iterations)."""

    def close(self) -> None:
        """Drop pending state and stop helpers, without waiting on the wire."""


@runtime_checkable
class LinkControl(Protocol):
    """The router's surface for the control loop: each direction (``Kind.F``, ``Kind.B``) of each link
    has a path, a ``Route`` (``Route.DIRECT`` or ``Route.DELEGATED``; ``set_link_mode`` takes a route's
    text too). ``events`` holds one line per path change forced by a failure or
    fault (each is also logged)."""

    events: list

    def link_mode(self, link: int, kind: Kind = Kind.F) -> Route:
        """The path of direction ``kind`` of ``link`` (``Route.DIRECT`` unless moved)."""

    def set_link_mode(self, link: int, mode: Route, queues: Optional[int] = None) -> None:
        """Move both directions of ``link`` to ``mode`` at an iteration boundary, on both of its ends, after
        ``wait_sends``; ``queues``: delegate FIFOs per direction of a delegated link (grows, never shrinks)."""

    def queues_of(self, link: int) -> int:
        """Delegate FIFOs per direction that ``link`` uses when delegated."""

    def delegate_pid(self, link: int, kind: Kind, sending: bool, queue: int) -> int:
        """Process id of the delegate serving ``queue`` of that direction of ``link`` on this rank (started)."""

    def prewarm(self) -> None:
        """Get ready to delegate a link soon (start what delegates come from); returns at once."""


@runtime_checkable
class DeferredSends(Protocol):
    """A transport whose real sends run later in its own thread: ``on_failure`` (if set) is called there
    with the ``DeliveryError`` of a message whose send failed; the error is raised again at the next
    ``send`` or ``wait_sends`` all the same."""

    on_failure: Optional[Callable[[DeliveryError], None]]
