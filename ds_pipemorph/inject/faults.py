"""Fault injection for failover tests (PipeMorph §5.3): transport wrappers (``pipemorph.inject.faults``).

- ``FaultyLink`` wraps the direct path: on a link of ``link_fails_after`` = {link: K}, each direction
  ("F" and "B") carries K messages and then fails for message K+1 onwards, on both ends (the sender's
  K+1-th send and the receiver's K+1-th receive of that direction raise ``TransportError``), as a
  broken RNIC would. Both ends agree on "K+1-th" because they count in issue order, which is
  micro-batch order for every plan of this project. It sits under the delay injection, next to the
  wire: on a delayed link the send fails in the delivery thread, after the delay.
- ``DelegateKiller`` wraps a ``LinkRouter``: on the rank that sends activations over link L, right after
  its N-th activation send on L, it SIGKILLs the sender delegate that carries that message (the message
  is then usually not acknowledged yet, so recovery must re-send it); with ``kill_side="recv"``, on the
  rank that receives them, right after its N-th activation receive, the receiver delegate that carries
  the next one.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field

from ..plan.ir.links import Route
from ..plan.ir.ops import Kind, message_op
from ..runtime.config import PipeMorphConfigError
from ..runtime.transport.protocol import TransportError, link_of
from .wrapping import RouterWrapper, TransportWrapper

log = logging.getLogger("ds_pipemorph.faults")


@dataclass
class Faults:
    link_fails_after: dict[int, int] = field(default_factory=dict)  # link -> messages per direction before failing
    kill_delegate: tuple[int, int] | None = None  # (link, after this many activation messages on it)
    kill_side: str = "send"  # "send": the sender delegate on stage L; "recv": the receiver delegate on stage L+1


def faults_from_config(faults_cfg, stages: int) -> Faults | None:
    """``Faults`` from the ``pipemorph.inject.faults`` section (None: none configured).

    Raises PipeMorphConfigError with one sentence for a link the job does not have.
    """
    if faults_cfg is None:
        return None
    links = stages - 1

    def check(link: int, key: str) -> int:
        if link >= links:
            raise PipeMorphConfigError(f"ds_config pipemorph.inject.faults.{key} names link {link}, but a "
                                       f"{stages}-stage pipeline has links 0..{links - 1}")
        return link

    fails = {check(int(k), "link_fails_after"): n for k, n in faults_cfg.link_fails_after.items()}
    kill = faults_cfg.kill_delegate
    if kill is None:
        return Faults(link_fails_after=fails) if fails else None
    return Faults(link_fails_after=fails, kill_delegate=(check(kill.link, "kill_delegate"), kill.after),
                  kill_side=kill.side)


class FaultyLink(TransportWrapper):
    """Direct-path wrapper whose links in ``faults.link_fails_after`` break after K messages per direction."""

    def __init__(self, inner, rank: int, stage_id: int, faults: Faults):
        super().__init__(inner)
        self.rank, self.stage_id = rank, stage_id
        self.fails_after = dict(faults.link_fails_after)
        self.count: dict[tuple[int, Kind], int] = {}  # messages sent or received, per (link, kind)
        self._index: dict[tuple[Kind, int], int] = {}  # a received message posted ahead -> its number

    def _fails(self, link: int, kind: Kind, mb: int, n: int, sending: bool) -> None:
        if n > self.fails_after[link]:
            op = message_op(kind, mb, sending)
            raise TransportError(f"rank {self.rank}: {op} on link {link} failed: injected fault "
                                 f"(link {link} fails after {self.fails_after[link]} {kind} messages)")

    def _number(self, link: int, kind: Kind) -> int:
        """The next message's number in this direction of ``link`` (1, 2, ...)."""
        self.count[(link, kind)] = self.count.get((link, kind), 0) + 1
        return self.count[(link, kind)]

    def post_recv(self, kind: Kind, mb: int) -> None:
        """Numbered when first posted, in the stream's order; posted up to the K-th message of a failing
        direction and never after (its ``recv`` fails), so none dangles and the wire keeps the order."""
        link = link_of(self.stage_id, kind, False)
        if link not in self.fails_after:
            return self.inner.post_recv(kind, mb)
        n = self._index.get((kind, mb))
        if n is None:
            n = self._index[(kind, mb)] = self._number(link, kind)
        if n <= self.fails_after[link]:
            self.inner.post_recv(kind, mb)

    def send(self, kind: Kind, mb: int, payload) -> None:
        link = link_of(self.stage_id, kind, True)
        if link in self.fails_after:
            self._fails(link, kind, mb, self._number(link, kind), True)
        self.inner.send(kind, mb, payload)

    def recv(self, kind: Kind, mb: int):
        """Fails exactly when the message's number (given when it was posted, or now) is above K."""
        link = link_of(self.stage_id, kind, False)
        if link in self.fails_after:
            n = self._index.pop((kind, mb), None)
            self._fails(link, kind, mb, self._number(link, kind) if n is None else n, False)
        return self.inner.recv(kind, mb)


class DelegateKiller(RouterWrapper):
    """Router wrapper: SIGKILL one delegate of link L after this rank's N-th activation message on L."""

    def __init__(self, router, faults: Faults):
        super().__init__(router)
        self.link, self.after = faults.kill_delegate
        self.side = faults.kill_side
        if self.side not in ("send", "recv"):
            raise ValueError(f"kill_side must be 'send' or 'recv', not '{self.side}'")
        self.count = 0
        self.killed: int | None = None

    def send(self, kind: Kind, mb: int, payload) -> None:
        self.inner.send(kind, mb, payload)
        if kind == Kind.F and self.side == "send" and link_of(self.stage_id, Kind.F, True) == self.link:
            self._maybe_kill(sending=True, queue_of=lambda n, k: (n - 1) % k)

    def recv(self, kind: Kind, mb: int):
        out = self.inner.recv(kind, mb)
        if kind == Kind.F and self.side == "recv" and link_of(self.stage_id, Kind.F, False) == self.link:
            self._maybe_kill(sending=False, queue_of=lambda n, k: n % k)
        return out

    def _maybe_kill(self, sending: bool, queue_of) -> None:
        if self.killed is not None:
            return
        self.count += 1
        if self.count < self.after:
            return
        if self.link_mode(self.link, Kind.F) is not Route.DELEGATED:
            raise TransportError(f"rank {self.rank}: kill_delegate names link {self.link}, "
                                 f"which is not delegated at message {self.count}")
        queue = queue_of(self.count, self.queues_of(self.link))
        self.killed = self.delegate_pid(self.link, Kind.F, sending, queue)
        os.kill(self.killed, signal.SIGKILL)
        role = "sender" if sending else "receiver"
        line = (f"rank {self.rank}: link {self.link}: injected fault: killed the {role} delegate of "
                f"F queue {queue} (pid {self.killed}) after {self.count} messages")
        self.events.append(line)
        log.warning(line)
