"""``DelegatedTransport``: messages leave through host staging rings and delegate processes (PipeMorph §5.2).

What each process owns:

- The training process (this object) creates, per link direction it sends or receives on, ``queues``
  staging rings and starts one delegate per ring (from a fork server that preloaded torch: see
  ``_delegate_context``; daemon, started once, reused across iterations; ``start_link`` may restart
  a link's delegates with more queues at an iteration boundary). ``send`` copies the message (a small header + every tensor's bytes, cut into pieces of
  at most one slot) into the next send ring round-robin and returns: it waits only while every slot of
  that ring is full. It keeps a reference to the payload until the receiving side has acknowledged the
  message, so a message is never lost when a delegate dies: the dead delegate is restarted (next
  generation, fresh ring) and every unacknowledged message of its queue is pushed again. The copy
  itself runs in a copy thread (``copier.Copier``), in send order, while the training thread goes on;
  ``wait_sends`` waits for it. How the bytes move is chosen once from the device of the transport's
  tensors (``staging.device_path``): on the CPU the copy thread memcpys them into the slots; on a CUDA
  device the send only records an event on the compute stream, the copy thread enqueues the
  device-to-host copies into the pinned slots on a side stream after that event, and a stream callback
  publishes each slot (§5.2's copy stream: nothing on the host waits for a copy).
- A sender delegate drains its ring, applies the injected delay of its link (one message in flight per
  queue: k queues are k independent FIFOs) and sends over its own two-process Gloo group; the receiver
  delegate on the neighbour rank fills the receiving training process's ring ahead of need
  (``delegate_proc``). The delay is looked up per message, when the delegate sends it: the training
  process shares its current static delays and its trace origin (``DelaySchedule.start()``, set by its
  first message) with its delegates through shared memory, so a trace replays on the same clock on
  both paths and a static delay changed at runtime reaches delegates that are already running.
- ``recv(kind, mb)`` takes messages in sequence order, which is round-robin over the receive rings
  (message n travels in queue n % k), stashes those for other (kind, mb) and drops duplicates by
  (message seq, piece). A receive posted ahead (``post_recv``, as the engine does one message ahead
  in plan order) lets a prefetch thread of that direction copy the message out of its ring as soon
  as it arrives, while the training thread computes (on a CUDA device it enqueues the host-to-device
  copies on a side stream, a stream callback frees the slot, and ``recv`` makes the consumer's stream
  wait on an event); it copies only messages posted ahead, so at an iteration boundary, when every
  posted message was taken, it is idle and nothing of the next iteration is read early.

Every wait is cut into short slices that check the delegate is alive and ends with a
``TransportTimeout`` naming rank, op, link and queue. ``wait_sends`` returns once every message sent
so far is held by the peer rank's receive ring (the delegated analogue of DirectTransport's).

Threads: ``send`` may run in another thread than ``recv`` (the failover of a delayed link re-sends
from its delivery thread). A lock covers sending,
starting directions and restarting delegates; the receiving side of a direction is served by one
thread at a time (the training thread in ``recv`` or the direction's prefetch thread: the ``busy``
flag under the direction's condition), and its waits on a ring run outside every lock.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from ..staging.device_path import select_path
from .delegate_proc import (
    MAX_PIECES,
    PEER_LOST,
    SLICE_S,
    DelegateSpec,
    interface_for,
    make_tag,
    split_tag,
)
from .config import DelegationConfig
from .copier import Copier
from .delegate_proc import main as delegate_main
from .transport import (
    HEADER_INTS,
    KINDS,
    TransportError,
    TransportTimeout,
    decode_header,
    encode_header,
)

log = logging.getLogger("ds_pipemorph.delegated")

PREFIX_INTS = 8  # [magic, seq, kind, mb, total bytes, pieces, 0, 0] before transport.encode_header's ints
HEAD_BYTES = (PREFIX_INTS + HEADER_INTS) * 8  # 576, a multiple of the 64-byte alignment
MAGIC = 0x504D444C  # "PMDL"
ALIGN = 64
_instances = itertools.count()


def _delegate_context():
    """Where delegates come from: a fork server that has imported torch and the delegate code once,
    so a delegate starts in a fraction of a second instead of importing torch afresh (seconds, tens
    of seconds on a loaded host: too long to switch a slow link at an iteration boundary). Each
    delegate is still a fresh fork of a process that never ran CUDA or training threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ds_pipemorph.runtime.delegate_proc"])
    return ctx


@contextlib.contextmanager
def _main_module_hidden():
    """Start a delegate without re-running the training script in it: multiprocessing imports the
    parent's ``__main__`` in every spawned or fork-server child, and a training script without an
    ``if __name__ == "__main__"`` guard would then start training again inside the delegate. The
    delegate needs only this package, so the child is told there is no main module to import."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype and device, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


@dataclass
class _Message:
    seq: int
    head: torch.Tensor  # int64 header
    tensors: list  # contiguous tensors (kept until acknowledged)
    what: str
    ready: Any = None  # the staging path's mark that the tensors are computed (a CUDA event), or None


def _layout(head: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """Segments (offset, uint8 view) of the flat byte stream of a message, and its length."""
    segs, off = [(0, _bytes_of(head))], HEAD_BYTES
    for t in tensors:
        b = _bytes_of(t)
        segs.append((off, b))
        off = _align(off + b.numel())
    return segs, off


def _copy_range(segs, a: int, b: int, piece: torch.Tensor, into_piece: bool, spans: list | None = None) -> None:
    """Copy the bytes [a, b) of the flat stream between the segments and ``piece`` (its bytes a..b).

    With ``spans`` (``piece`` is a staging slot on the CUDA path), a segment in device memory is not copied here
    but listed as (slot offset, device address, bytes) for the asynchronous copy that ends the slot."""
    for off, seg in segs:
        lo, hi = max(a, off), min(b, off + seg.numel())
        if lo >= hi:
            continue
        if spans is not None and seg.is_cuda:
            spans.append((lo - a, seg.data_ptr() + (lo - off), hi - lo))
        elif into_piece:
            piece[lo - a: hi - a].copy_(seg[lo - off: hi - off])
        else:
            seg[lo - off: hi - off].copy_(piece[lo - a: hi - a])


@dataclass
class _Queue:
    """One ring and the delegate that serves it."""

    index: int
    ring: Any
    proc: Any
    gen: Any  # mp.Value: generation of the pair's rendezvous (the delegate sets the next one when its peer goes)
    stop: Any
    acked: Any  # mp.Value: last message seq the peer holds (sender queues)
    ready: Any
    born: int = 0  # the generation this delegate was started for
    old_rings: list = field(default_factory=list)  # receive side: rings of a dead delegate, drained first
    unacked: deque = field(default_factory=deque)  # send side: _Message kept until acknowledged


@dataclass
class _Direction:
    link: int
    kind: str
    sending: bool
    queues: list
    next_seq: int = 0  # send: next seq to assign; recv: next seq to take
    active: int = 0  # queues in use (a prefix of ``queues``; the rest are started and idle)
    base_seq: int = 0  # the first message of the current queue count: seq s goes to (s - base_seq) % active
    stash: dict = field(default_factory=dict)  # recv: (kind, mb) -> payload
    partial: dict | None = None  # recv: message being assembled
    # recv side, shared with the prefetch thread (under ``cv``):
    cv: threading.Condition = field(default_factory=threading.Condition)
    posted: dict = field(default_factory=dict)  # (kind, mb) posted or asked for and not yet returned (ordered)
    announced: int = 0  # messages posted so far: the prefetcher assembles messages next_seq < announced
    busy: bool = False  # a thread is taking a piece from a ring
    error: BaseException | None = None  # the prefetcher's failure, raised by the next recv
    prefetcher: threading.Thread | None = None

    def queue_for(self, seq: int):
        return self.queues[(seq - self.base_seq) % self.active]


class DelegatedTransport:
    """Same interface as ``DirectTransport``; see the module docstring for who owns what.

    ``delays`` (an ``inject.DelaySchedule``) is applied inside the sender delegates. Delegates of a
    link direction are started on first use or by ``start_link``; both ends of a link must use the
    same ``queues`` and create their transports in the same order (that order names the rendezvous).
    """

    name = "delegated"

    def __init__(self, rank: int, stage_id: int, stage_ranks: Sequence[int], timeout_s: float = 300.0,
                 device: torch.device | None = None, queues: int = 2, max_queues: int | None = None, delays=None,
                 slot_bytes: int | None = None, num_slots: int | None = None, session: str | None = None,
                 store_addr: str | None = None, store_port: int | None = None,
                 interfaces: Sequence[str] | None = None):
        if queues < 1:
            raise ValueError(f"rank {rank}: delegated transport needs at least 1 queue, got {queues}")
        if slot_bytes is None or num_slots is None:  # the ds_config's defaults (delegation.slot_mb, slots)
            defaults = DelegationConfig()
            slot_bytes = defaults.slot_mb << 20 if slot_bytes is None else slot_bytes
            num_slots = defaults.slots if num_slots is None else num_slots
        if slot_bytes < 4096:
            raise ValueError(f"rank {rank}: staging slots must hold at least 4096 bytes, got {slot_bytes}")
        self.rank, self.stage_id = rank, stage_id
        self.stage_ranks = list(stage_ranks)
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self.staging_path = select_path(self.device)  # host memcpy, or CUDA copies on side streams
        self.k = queues
        self.max_k = max(queues, max_queues or queues)  # delegates started per direction (growing needs no start)
        self.delays = delays
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.session = session or f"t{next(_instances)}"
        self.store_addr = store_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = store_port or os.environ.get("MASTER_PORT")
        if not port:
            raise ValueError(f"rank {rank}: delegated transport needs the job's store: set MASTER_PORT (the "
                             f"delegates meet through a TCPStore client on MASTER_ADDR:MASTER_PORT)")
        self.store_port = int(port)
        self.interfaces = tuple(interfaces or ())
        self.events: list[str] = []  # one line per delegate restart (also logged)
        self.send_s: dict[int, float] = {}  # link -> seconds spent inside send (copy + full-ring waits)
        self.sent: dict[int, int] = {}
        self._dirs: dict[tuple[int, str, bool], _Direction] = {}
        self._ctx = _delegate_context()
        self._link_k: dict[int, int] = {}  # link -> queues per direction, where not self.k
        self._op = None
        self._closed = False
        self._lock = threading.RLock()
        self._copier = Copier(self._push_locked, f"rank {rank} staging copies")
        self._shared_delays = None  # (origin mp.Value, static mp.Array): what sender delegates read per message

    def prepare(self) -> None:
        """Build (or load from the cache) the staging op and start the fork server now, so that the first
        link switched to the delegates waits for neither: a first JIT build takes tens of seconds, the
        fork server imports torch (seconds, tens of seconds on a loaded host). Only the op variant this
        transport's device needs is built. A failed build is logged and raised again when a link first
        goes delegated (a job whose links all stay direct does not need the op)."""
        from multiprocessing import forkserver

        from ..staging.ring import op_builder

        builder = op_builder(cuda=self.staging_path.cuda)
        local = os.environ.get("LOCAL_RANK")
        if (int(local) == 0) if local is not None else self.rank == 0:  # once per node
            log.warning("building the staging op %s for delegated links (once, cached under "
                        "$TORCH_EXTENSIONS_DIR)", builder.name)
        try:
            self._load_op()
        except Exception as e:  # noqa: BLE001  (raised again by _load_op at the first delegated link)
            log.warning("rank %d: cannot build the staging op %s (%s); a link switched to the delegates "
                        "will fail", self.rank, builder.name, e)
        with _main_module_hidden():
            forkserver.ensure_running()

    # -- naming -------------------------------------------------------------------------------
    def _link(self, kind: str, sending: bool) -> int:
        down = (kind == "F") == sending
        return self.stage_id if down else self.stage_id - 1

    def _describe(self, kind: str, mb: int, sending: bool, queue: int | None = None) -> str:
        down = (kind == "F") == sending
        peer = self.stage_id + 1 if down else self.stage_id - 1
        verb, prep = ("SEND", "to") if sending else ("RECV", "from")
        q = "" if queue is None else f" queue {queue}"
        return f"{verb}_{kind}{mb} on link {self._link(kind, sending)}{q} {prep} stage {peer}"

    def _ring_name(self, link: int, kind: str, sending: bool, q: int, gen: int) -> str:
        role = "s" if sending else "r"
        return f"pm_{os.getpid()}_{self.session}_{link}{kind}{role}{q}_g{gen}"

    # -- delegates ----------------------------------------------------------------------------
    def _load_op(self):
        if self._op is None:
            from ..staging.ring import load_op

            self._op = load_op(cuda=self.staging_path.cuda)
        return self._op

    def _spawn(self, link: int, kind: str, sending: bool, q: int, gen_value: int, stop=None):
        from ..staging.ring import StagingRing

        op = self._load_op()
        try:
            ring = StagingRing.create(self._ring_name(link, kind, sending, q, gen_value),
                                      slot_bytes=self.slot_bytes, num_slots=self.num_slots, op=op)
        except RuntimeError as e:
            if "large enough" not in str(e):
                raise
            raise TransportError(f"rank {self.rank}: link {link}: {e}; or lower ds_config "
                                 f"pipemorph.delegation.slot_mb / slots") from None
        self.staging_path.pin(ring)  # CUDA: page-lock it now, at link start, not inside the first copy
        gen = self._ctx.Value("q", gen_value, lock=False)  # single writer: the delegate
        stop = stop if stop is not None else self._ctx.Value("b", 0, lock=False)  # single writer: this process
        acked = self._ctx.Value("q", -1, lock=False)
        ready = self._ctx.Value("b", 0, lock=False)
        spec = DelegateSpec(
            role="send" if sending else "recv", rank=self.rank, link=link, kind=kind, queue=q,
            ring_name=ring.name, op_name=op.__name__, op_path=op.__file__, store_addr=self.store_addr,
            store_port=self.store_port,
            prefix=f"pipemorph/delegates/{self.session}/L{link}{kind}/q{q}",
            parent_pid=os.getpid(), timeout_s=self.timeout_s,
            delays_trace=self.delays.trace if (sending and self.delays is not None) else None,
            interfaces=self.interfaces)
        delays = self._delay_state() if sending else None
        proc = self._ctx.Process(target=delegate_main, args=(spec, gen, stop, acked, ready, delays), daemon=True,
                                 name=f"pipemorph-{spec.role}-L{link}{kind}q{q}")
        with _main_module_hidden():
            proc.start()
        return ring, proc, gen, stop, acked, ready

    def _delay_state(self):
        """(origin, static delays) in shared memory, created once; every sender delegate reads them."""
        if self._shared_delays is None:
            origin = self._ctx.Value("d", math.nan, lock=False)  # single writer: this process
            static = self._ctx.Array("d", max(1, len(self.stage_ranks) - 1), lock=False)
            self._shared_delays = (origin, static)
            self._publish_delays(start=False)
        return self._shared_delays

    def _publish_delays(self, start: bool = True) -> None:
        """Hand the current static delays and the trace origin (started by the first message, unless
        ``start`` is False) to the delegates: before each message is pushed, and at their spawn."""
        d = self.delays
        if d is None or self._shared_delays is None:
            return
        origin, static = self._shared_delays
        t0 = d.start() if start else d.origin
        if t0 is not None:
            origin.value = t0
        for i, c in enumerate(d.static[: len(static)]):
            static[i] = c

    def _direction(self, kind: str, sending: bool) -> _Direction:
        link = self._link(kind, sending)
        key = (link, kind, sending)
        d = self._dirs.get(key)
        if d is None:
            with self._lock:
                d = self._dirs.get(key)
                if d is not None:
                    return d
                if self._closed:
                    raise TransportError(f"rank {self.rank}: delegated transport is closed")
                queues = []
                active = self._link_k.get(link, self.k)
                for q in range(max(active, self.max_k)):
                    ring, proc, gen, stop, acked, ready = self._spawn(link, kind, sending, q, 0)
                    queues.append(_Queue(q, ring, proc, gen, stop, acked, ready))
                d = self._dirs[key] = _Direction(link, kind, sending, queues, active=active)
        return d

    def start_link(self, link: int, queues: int | None = None) -> None:
        """Start the delegates of every direction this rank uses on ``link`` (idempotent), with
        ``queues`` FIFOs per direction in use (default: the transport's). A direction starts
        ``max_queues`` delegates at once; asking for more queues than a running direction uses
        spreads messages from the next one on over more of them (starting more delegates beside
        the running ones only beyond ``max_queues``; nothing restarts): call it on both ends at the
        same iteration boundary, when the receiver has taken every message sent so far. A
        direction never shrinks (idle queues cost an idle process and untouched shared memory)."""
        if link == self.stage_id:  # this rank sends activations down and receives gradients up
            keys = (("F", True), ("B", False))
        elif link == self.stage_id - 1:
            keys = (("F", False), ("B", True))
        else:
            raise ValueError(f"rank {self.rank}: stage {self.stage_id} is not an end of link {link}")
        if queues is not None:
            if queues < 1:
                raise ValueError(f"rank {self.rank}: link {link} needs at least 1 queue, got {queues}")
            with self._lock:
                if queues > self._link_k.get(link, self.k):
                    self._link_k[link] = queues
                    for kind, sending in keys:
                        d = self._dirs.get((link, kind, sending))
                        if d is not None and d.active < queues:
                            self._grow(d, queues)
        for kind, sending in keys:
            self._direction(kind, sending)

    def queues_of(self, link: int) -> int:
        """FIFOs per direction that ``link`` uses (or will use when it starts)."""
        return self._link_k.get(link, self.k)

    def _grow(self, d: _Direction, queues: int) -> None:
        """Add delegates to a running direction so that it has ``queues``; both ends switch the
        mapping of messages to queues at the same message (the next one), which they agree on
        because the receiver holds everything sent so far. Messages already in a queue stay there
        (a restart after a delegate dies re-sends them into the same queue)."""
        if not d.sending and (d.stash or d.partial or d.busy):
            raise TransportError(f"rank {self.rank}: link {d.link} {d.kind}: cannot add delegate queues while "
                                 f"received messages wait to be taken (call it at an iteration boundary)")
        for q in range(len(d.queues), queues):
            ring, proc, gen, stop, acked, ready = self._spawn(d.link, d.kind, d.sending, q, 0)
            d.queues.append(_Queue(q, ring, proc, gen, stop, acked, ready))
        d.active, d.base_seq = queues, d.next_seq
        log.info("rank %d: link %d %s %s: %d delegate queues from message %d", self.rank, d.link, d.kind,
                 "sender" if d.sending else "receiver", queues, d.next_seq)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every started delegate has formed its Gloo pair (optional: sends never need it)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for d in self._dirs.values():
            for q in d.queues:
                while not q.ready.value:
                    with self._lock:
                        self._check_alive(d, q, f"waiting for the delegates of link {d.link} {d.kind}")
                    if time.monotonic() > deadline:
                        raise TransportTimeout(
                            f"rank {self.rank}: the {'sender' if d.sending else 'receiver'} delegate of link "
                            f"{d.link} {d.kind} queue {q.index} did not meet its peer within {timeout_s or self.timeout_s:g} s")
                    time.sleep(0.01)

    def delegate_pid(self, link: int, kind: str, sending: bool, queue: int) -> int:
        return self._dirs[(link, kind, sending)].queues[queue].proc.pid

    def _health(self, what: str) -> None:
        """Restart every delegate of this rank that died (called from each slice of every wait, so a
        dead delegate of another direction is noticed while this process waits on the peer)."""
        with self._lock:
            for d in list(self._dirs.values()):
                for q in d.queues:
                    self._check_alive(d, q, what)

    def _check_alive(self, d: _Direction, q: _Queue, what: str) -> bool:
        """Restart the delegate of ``q`` if it died; True if it did."""
        if q.proc.is_alive():
            return False
        self._restart(d, q, what)
        return True

    def _restart(self, d: _Direction, q: _Queue, what: str) -> None:
        old_pid, old_code = q.proc.pid, q.proc.exitcode
        # The next generation, whatever the exit. Not ``gen.value + 1``: a delegate that failed just
        # after its watchdog had moved ``gen`` on (or after PEER_LOST set it) would skip one, and the
        # two ends would then wait for each other in different generations.
        gen = q.born + 1
        ring, proc, genv, _, acked, ready = self._spawn(d.link, d.kind, d.sending, q.index, gen, stop=q.stop)
        if d.sending:
            q.ring.close()
            acked.value = q.acked.value
            q.ring, q.proc, q.gen, q.acked, q.ready, q.born = ring, proc, genv, acked, ready, gen
            resend = list(q.unacked)
            for m in resend:
                self._push(d, q, m)
        else:
            q.old_rings.append(q.ring)
            q.ring, q.proc, q.gen, q.ready, q.born = ring, proc, genv, ready, gen
            resend = []
        why = "lost its peer" if old_code == PEER_LOST else f"died (exit code {old_code})"
        line = (f"rank {self.rank}: link {d.link}: {'sender' if d.sending else 'receiver'} delegate of "
                f"{d.kind} queue {q.index} (pid {old_pid}) {why} while {what}; restarted it "
                f"as generation {gen}" + (f" on interface {interface_for(self.interfaces, gen)}"
                                          if self.interfaces else "")
                + (f" and re-sent {len(resend)} unacknowledged messages" if d.sending else ""))
        self.events.append(line)
        log.warning(line)

    # -- sending ------------------------------------------------------------------------------
    def send(self, kind: str, mb: int, payload: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Copy message (kind, mb) into the next send ring and return (waits only on a full ring)."""
        with self._lock:
            self._send(kind, mb, payload)

    def _send(self, kind: str, mb: int, payload) -> None:
        t0 = time.perf_counter()
        self._copier.check()
        d = self._direction(kind, True)
        self._publish_delays()
        bare = isinstance(payload, torch.Tensor)
        tensors = [self.staging_path.outgoing(t) for t in ([payload] if bare else payload)]
        meta = encode_header(tensors, bare)
        _, total = _layout(torch.zeros(PREFIX_INTS + HEADER_INTS, dtype=torch.int64), tensors)
        pieces = max(1, -(-total // self.slot_bytes))
        if pieces > MAX_PIECES:
            raise TransportError(f"rank {self.rank}: {self._describe(kind, mb, True)}: a message of {total} bytes "
                                 f"needs {pieces} staging slots of {self.slot_bytes} bytes (at most {MAX_PIECES})")
        head = torch.zeros(PREFIX_INTS + HEADER_INTS, dtype=torch.int64)
        head[:6] = torch.tensor([MAGIC, d.next_seq, KINDS[kind], mb, total, pieces])
        head[PREFIX_INTS:] = meta
        q = d.queue_for(d.next_seq)
        self._check_alive(d, q, "sending")  # a waitpid(WNOHANG): microseconds
        msg = _Message(d.next_seq, head, tensors, self._describe(kind, mb, True, q.index),
                       self.staging_path.sent(tensors))
        d.next_seq += 1
        self._prune(q)
        q.unacked.append(msg)
        self._copier.submit(d, q, msg)  # the copy into the ring runs beside the next op (§5.2)
        self.send_s[d.link] = self.send_s.get(d.link, 0.0) + time.perf_counter() - t0
        self.sent[d.link] = self.sent.get(d.link, 0) + 1

    def _push_locked(self, d: _Direction, q: _Queue, msg: _Message) -> None:
        with self._lock:
            if not self._closed:
                self._push(d, q, msg)

    def _push(self, d: _Direction, q: _Queue, msg: _Message) -> None:
        segs, total = _layout(msg.head, msg.tensors)
        pieces = max(1, -(-total // self.slot_bytes))
        ring, path = q.ring, self.staging_path
        for p in range(pieces):
            a, b = p * self.slot_bytes, min(total, (p + 1) * self.slot_bytes)
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    with path.sending(msg.ready), \
                            path.writing(ring, b - a, make_tag(msg.seq, pieces, p), SLICE_S) as (view, spans):
                        _copy_range(segs, a, b, view, True, spans)
                    break
                except TimeoutError:
                    if self._check_alive(d, q, f"{msg.what} waited for a free staging slot"):
                        return  # the restart pushed every unacknowledged message, this one included
                    if time.monotonic() > deadline:
                        raise TransportTimeout(
                            f"rank {self.rank}: {msg.what} timed out after {self.timeout_s:g} s waiting for a free "
                            f"staging slot (the sender delegate is not draining ring {ring.name})") from None

    def _prune(self, q: _Queue) -> None:
        done = q.acked.value
        while q.unacked and q.unacked[0].seq <= done:
            q.unacked.popleft()

    def wait_sends(self) -> None:
        """Wait until the peer ranks' receive rings hold every message sent so far (restarting dead delegates)."""
        self._copier.drain(self.timeout_s)
        for d in list(self._dirs.values()):
            if not d.sending:
                continue
            for q in d.queues:
                deadline = time.monotonic() + self.timeout_s
                last = time.monotonic()
                while True:
                    with self._lock:
                        self._prune(q)
                        if not q.unacked:
                            break
                    now = time.monotonic()
                    if now - last > SLICE_S:
                        last = now
                        self._health(f"{q.unacked[0].what} waited to be delivered")
                    if now > deadline:
                        raise TransportTimeout(
                            f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for "
                            f"{q.unacked[0].what} to be received ({len(q.unacked)} messages unacknowledged)")
                    time.sleep(0.0002)

    # -- receiving ----------------------------------------------------------------------------
    def post_recv(self, kind: str, mb: int) -> None:
        """Receiver delegates fill the rings ahead of need; posting the receive also lets the
        direction's prefetch thread copy the message out of its ring as soon as it is in."""
        d = self._direction(kind, False)
        with d.cv:
            self._announce(d, (kind, mb))
            if d.prefetcher is None and not self._closed:
                d.prefetcher = threading.Thread(target=self._prefetch_loop, args=(d,), daemon=True,
                                                name=f"rank {self.rank} link {d.link} {d.kind} prefetch")
                d.prefetcher.start()

    @staticmethod
    def _announce(d: _Direction, key: tuple) -> None:
        """Count message ``key`` as expected (once until it is returned); caller holds ``d.cv``."""
        if key not in d.posted:
            d.posted[key] = None
            d.announced += 1
            d.cv.notify_all()

    def _prefetch_loop(self, d: _Direction) -> None:
        """Assemble posted messages into the stash as they arrive (off the training thread)."""
        while True:
            with d.cv:
                while not self._closed and d.error is None and (d.busy or d.next_seq >= d.announced):
                    d.cv.wait(SLICE_S)
                if self._closed or d.error is not None:
                    return
                d.busy = True
                kind, mb = next(iter(d.posted), (d.kind, -1))
            try:
                self._take_piece(d, d.queue_for(d.next_seq), self._describe(kind, mb, False))
            except BaseException as e:  # noqa: BLE001  (raised by the next recv)
                with d.cv:
                    d.error = e
            finally:
                with d.cv:
                    d.busy = False
                    d.cv.notify_all()

    def recv(self, kind: str, mb: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Wait for message (kind, mb); other messages that arrive first are stashed for their recv."""
        d = self._direction(kind, False)
        key = (kind, mb)
        what = self._describe(kind, mb, False)
        deadline = time.monotonic() + self.timeout_s
        while True:
            with d.cv:
                self._announce(d, key)
                while d.error is None and key not in d.stash and d.busy:
                    d.cv.wait(SLICE_S)  # the prefetcher is taking a piece: perhaps this message's
                    if time.monotonic() > deadline:
                        break
                if d.error is not None:
                    raise d.error
                if key in d.stash:
                    bare, tensors, ready = d.stash.pop(key)
                    del d.posted[key]
                    break
                if time.monotonic() > deadline:
                    raise TransportTimeout(
                        f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {what} "
                        f"(next message {d.next_seq} is due in queue {d.queue_for(d.next_seq).index})")
                d.busy = True
            try:
                self._take_piece(d, d.queue_for(d.next_seq), what)
            finally:
                with d.cv:
                    d.busy = False
                    d.cv.notify_all()
        tensors = self.staging_path.hand_over(tensors, ready)  # CUDA: this stream waits for the copies
        return tensors[0] if bare else tuple(tensors)

    def _take_piece(self, d: _Direction, q: _Queue, what: str) -> bool:
        """Consume one piece from queue ``q`` (old rings of a dead delegate first); False if none came.
        A message is stashed for its ``recv`` only once every copy of its last piece is enqueued."""
        path = self.staging_path
        with path.receiving():
            while q.old_rings:
                got = q.old_rings[0].try_pop()
                if got is None:
                    q.old_rings.pop(0).close()
                    continue
                self._stash(d, self._piece(d, got[0], got[1], what))
                return True
            try:
                with path.reading(q.ring, SLICE_S) as (view, tag, spans):
                    done = self._piece(d, view, tag, what, spans)
            except TimeoutError:
                self._health(f"{what} waited for a message")
                return False
            self._stash(d, done)
            return True

    def _stash(self, d: _Direction, done: tuple | None) -> None:
        if done is not None:
            key, bare, tensors = done
            d.stash[key] = (bare, tensors, self.staging_path.received())

    def _piece(self, d: _Direction, view: torch.Tensor, tag: int, what: str, spans: list | None = None):
        """Take one piece into the message being assembled; returns (key, bare, tensors) once it is complete."""
        seq, _, piece = split_tag(tag)
        if seq < d.next_seq:
            return None  # a duplicate re-sent after a delegate restart
        if seq > d.next_seq:
            raise TransportError(f"rank {self.rank}: {what}: message {seq} arrived while message {d.next_seq} "
                                 f"was due on link {d.link} (a message was lost)")
        flat = view.reshape(-1).view(torch.uint8) if view.numel() else view.reshape(-1)
        part = d.partial
        if piece == 0:  # (again, if a delegate died in the middle of a message)
            head = flat[:HEAD_BYTES].clone().view(torch.int64)
            magic, hseq, kind_id, mb, total, npieces = head[:6].tolist()
            if magic != MAGIC or hseq != seq:
                raise TransportError(f"rank {self.rank}: {what}: corrupt header in link {d.link} message {seq}")
            bare, metas = decode_header(head[PREFIX_INTS:])
            dev = self.staging_path.recv_device
            tensors = [torch.empty(shape, dtype=dtype, device=dev) for dtype, shape in metas]
            segs, _ = _layout(torch.zeros(PREFIX_INTS + HEADER_INTS, dtype=torch.int64), tensors)
            kind = "F" if kind_id == KINDS["F"] else "B"
            part = d.partial = dict(seq=seq, next=0, pieces=npieces, total=total, segs=segs[1:],
                                    key=(kind, mb), bare=bare, tensors=tensors)
        elif part is None or part["seq"] != seq or piece < part["next"]:
            return None  # a duplicate piece
        if piece != part["next"]:
            raise TransportError(f"rank {self.rank}: {what}: piece {piece} of link {d.link} message {seq} "
                                 f"arrived while piece {part['next']} was due")
        a = piece * self.slot_bytes
        _copy_range(part["segs"], a, a + flat.numel(), flat, False, spans)
        part["next"] = piece + 1
        if part["next"] < part["pieces"]:
            return None
        d.partial = None
        d.next_seq += 1
        return part["key"], part["bare"], part["tensors"]

    # -- lifecycle ----------------------------------------------------------------------------
    def reset_shapes(self) -> None:
        """Nothing to forget: every delegated message carries its layout."""

    def close(self) -> None:
        """Stop every delegate (they exit within ~50 ms) and unlink the rings; no waiting on the wire.
        Close only once the neighbour ranks' ``wait_sends`` returned (the engine closes after the
        step's collectives): a receiver delegate stopped earlier may never acknowledge their last message."""
        with self._lock:
            self._closed = True
        self._copier.stop()
        for d in self._dirs.values():
            with d.cv:
                d.cv.notify_all()
        for d in self._dirs.values():  # a prefetcher finishes its piece (one ring wait slice) and exits
            if d.prefetcher is not None:
                d.prefetcher.join(timeout=4 * SLICE_S)
        for d in self._dirs.values():
            for q in d.queues:
                q.stop.value = 1
        for d in self._dirs.values():
            for q in d.queues:
                q.proc.join(timeout=2.0)
                if q.proc.is_alive():
                    q.proc.kill()
                    q.proc.join(timeout=2.0)
                for r in [q.ring, *q.old_rings]:
                    r.close()
        self._dirs.clear()
