"""Main loop of one delegate process (PipeMorph §5.2): one queue of one link direction on one rank.

A *sender* delegate owns the consumer end of a staging ring filled by its training process and the
rank-0 end of a two-process Gloo group; a *receiver* delegate owns the rank-1 end of that group and
the producer end of a staging ring its training process reads. The pair never touches the training
processes' groups: it meets through its own rendezvous, a ``PrefixStore`` (one prefix per link,
direction, queue and generation) over a ``TCPStore`` client of the job's MASTER_ADDR/MASTER_PORT.

Wire protocol per ring entry (one piece of one message): sender sends ``[nbytes, tag]`` (int64),
then the bytes straight from the ring slot, and frees the slot; after the last piece of a message it
waits for a one-int ack the receiver sends once it published that piece into its ring. So a queue
has exactly one message in flight, its pieces stream back to back (no round trip per piece), and the
sender reports the message as delivered (``acked``) only once the receiver holds all of it: nothing
is lost when either delegate dies (the training process keeps every message until it is acked).
The injected delay of the link is applied once per message, before its first piece leaves (a FIFO
with one message in flight, as on the direct path), and looked up at that moment: the static delay its
training process currently has for the link, or the trace's delay at the time elapsed since the
training process's origin (both in shared memory).

Liveness: a connection can break in silence (a downed interface gives no socket error; TCP
retransmits until its own timeout, minutes), so the pair does not rely on its Gloo ops failing. Once
the Gloo group is formed, the pair opens a second TCP connection between the same two addresses (the
generation's interface), the *heartbeat* connection (``_Heartbeat``). What ends a pair is decided by
the kernels at both ends, never by how fast a process runs: the peer's process gone (its kernel
closes the connection: EOF or reset, at once), or its host or the network between gone (the peer's
kernel stops acknowledging: ``TCP_USER_TIMEOUT`` and keep-alive probes close the connection after
``liveness_s``, ``liveness_for``: a quarter of the training process's ``timeout_s``, at most
``LIVENESS_CAP_S``). A peer that is alive but starved of CPU, or stopped, for any time is not lost:
its kernel still acknowledges, and the training process's ``timeout_s`` bounds what it waits for.
Both ends also send a byte on it every ``liveness_s / 4``, so that unacknowledged data is in flight
and the user timeout runs. The pair's Gloo ops wait without a deadline of their own (``OP_WAIT``):
the heartbeat connection is what bounds them, and an idle queue is never restarted.

Closing in order: a delegate stopped by its training process (``stop``) first finishes an
acknowledgement it owes (the receiving training process may already have taken the message and
closed), then says ``BYE`` on the heartbeat connection; a delegate whose training process died says
``GONE``. Its peer then does not take the closed connection for a loss: it stays up until its own
training process stops it, and marks ``ready`` ``PEER_CLOSED`` or ``PEER_GONE``, so that a wait of
its training process for that peer fails at once with a sentence (naming the rank that died)
instead of restarting the pair for a rank that is not there or running into its timeout.

Resuming without duplicates: the receiving training process keeps, per queue, ``published``: the
seq of the last message whose last piece a receiver delegate of that queue published (shared with
every generation of the receiver delegate). When a pair meets, the receiver tells the sender that
number first; the sender then drops, without sending, the re-sent messages the receiving ring
already holds, and counts them as acknowledged. So the receiving rings get each message once; the
receiving training process still drops a duplicate by (message seq, piece) should one arrive (a
receiver delegate killed between publishing a message and recording it).

Failure handling: a delegate whose Gloo op fails (the peer died) or whose heartbeat connection closes
or fails exits with ``PEER_LOST`` after setting ``gen`` to the next generation; a watchdog thread also makes
it exit that way as soon as the peer's replacement announces a newer generation in the store. The
training process restarts any delegate that exited (fresh ring, next generation, on the next
interface of ``delegation.interfaces``) and pushes every unacknowledged message of that queue again,
in order. The watchdog also exits the process when the training process closes the transport
(``stop``) or dies (parent pid changes).

This module imports torch only (no deepspeed): the ring op is loaded from its built ``.so`` file.
"""
from __future__ import annotations

import importlib.util
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ....fileio import first_line
from ....staging.pages import release_pages

PIECE_BITS = 12  # a tag is (message seq << 24) | (pieces << 12) | piece
MAX_PIECES = (1 << PIECE_BITS) - 1
SLICE_S = 0.2  # waits on a ring are cut into slices so stop/parent death are noticed
LIVENESS_CAP_S = 5.0  # a peer host that acknowledges nothing this long (at most) is lost; see liveness_for
BEATS_PER_LIVENESS = 4  # heartbeats sent per liveness_s
# On the heartbeat connection: alive; closing in order (stopped by its training process); its training
# process is gone (the peer rank died).
BEAT, BYE, GONE = b"\x01", b"\x00", b"\x02"
PEER_CLOSED, PEER_GONE = 2, 3  # ``ready`` once the peer closed in order, or its rank died (1: the pair met)
ACK_GRACE_S = 2.0  # a delegate stopped while sending an acknowledgement finishes it first, this long at most
# Gloo ops of a formed pair wait this long: the heartbeat, not a Gloo timeout, decides that a pair is
# lost (a healthy pair may wait for hours: an idle queue, or a receiver whose training process is busy).
OP_WAIT = timedelta(days=7)


def liveness_for(timeout_s: float) -> float:
    """How long a delegate pair may hear nothing from each other before it counts as lost: a quarter
    of the training process's ``timeout_s`` and at most ``LIVENESS_CAP_S``, so that a pair broken in
    silence is noticed, restarted (on the next interface) and has re-sent its messages well before the
    training process, which waits up to ``timeout_s`` for a message, gives up."""
    return min(timeout_s / 4.0, LIVENESS_CAP_S)


def make_tag(seq: int, pieces: int, piece: int) -> int:
    return (seq << (2 * PIECE_BITS)) | (pieces << PIECE_BITS) | piece


def split_tag(tag: int) -> tuple[int, int, int]:
    """``(message seq, pieces in the message, piece index)``."""
    mask = (1 << PIECE_BITS) - 1
    return tag >> (2 * PIECE_BITS), (tag >> PIECE_BITS) & mask, tag & mask


@dataclass
class DelegateSpec:
    """Everything a delegate needs; picklable (it crosses the spawn boundary)."""

    role: str  # "send" | "recv"
    rank: int  # global rank of the training process that owns this delegate
    link: int
    kind: str  # "F" | "B"
    queue: int
    ring_name: str
    op_name: str
    op_path: str
    store_addr: str
    store_port: int
    prefix: str  # rendezvous prefix without the generation
    parent_pid: int
    timeout_s: float
    delays_trace: Any = None  # sender only: the trace of its process's hooks.DelaySource, if it replays one
    interfaces: tuple = ()  # network interfaces in turn per generation (delegation.interfaces); () = Gloo's default
    liveness_s: float = 0.0  # the peer's kernel silent this long: the pair is lost (0: liveness_for(timeout_s))
    fault_at: tuple | None = None  # testing: (point, message[, stall s]) where generation 0 dies or stalls (``fault_point``)
    release_pages: bool = False  # sender: punch each sent piece out of the ring (a host ring, not a pinned one)

    def interface(self, gen: int) -> str | None:
        return interface_for(self.interfaces, gen)

    def what(self) -> str:
        return f"rank {self.rank} {self.role} delegate of link {self.link} {self.kind} queue {self.queue}"

    def liveness(self) -> float:
        return self.liveness_s if self.liveness_s > 0 else liveness_for(self.timeout_s)


def interface_for(interfaces, gen: int) -> str | None:
    """The network interface of generation ``gen`` (both ends of a pair meet in the same one); None:
    Gloo's default."""
    return interfaces[gen % len(interfaces)] if interfaces else None


def missing_interfaces(names) -> str | None:
    """One sentence if this host lacks one of ``names`` (``delegation.interfaces``) or it has no IP
    address (Gloo binds to the interface's address), else None."""
    import socket

    import psutil

    addrs = psutil.net_if_addrs()
    usable = [n for n, a in addrs.items() if any(x.family in (socket.AF_INET, socket.AF_INET6) for x in a)]
    for n in names:
        if n not in usable:
            why = "has no IP address on" if n in addrs else "does not exist on"
            return (f"ds_config pipemorph.delegation.interfaces names '{n}', which {why} this host "
                    f"({socket.gethostname()}); interfaces with an address here: {', '.join(sorted(usable))}")
    return None


def _load_op(name: str, path: str):
    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_OP = None  # the ring op once loaded (the watchdog unlinks an orphaned ring with it)
# The pair's store client once connected; the watchdog shares it (a TCPStore client serialises its
# calls: TCPStore.hpp's activeOpLock_, so a rendezvous waiting for the peer's keys would hold up the
# watchdog's check on the same client). One client per delegate
# in the common case, not two: torch's TCPStore client can take 5 s to connect when many connect at
# once (measured here: every 25th client of a process, and bursts of clients). The watchdog opens
# its own only when a rendezvous lasts longer than RENDEZVOUS_WATCH_S.
_STORE = None
_MET = False  # the pair's Gloo group is formed
_WATCH_STORE = None
_HEARTBEAT = None  # the pair's heartbeat once connected (the watchdog says BYE on it when stopped)
# Held from publishing a message into the ring until its acknowledgement is sent: a stop waits for it.
_ACK_LOCK = threading.Lock()
RENDEZVOUS_WATCH_S = 5.0
PEER_LOST = 3  # exit code: the peer delegate died or was replaced; ``gen`` holds the generation to meet next


def _watch_store(spec: DelegateSpec, waited_s: float):
    """The store client the watchdog reads: the shared one once the pair met; before, none until the
    rendezvous has lasted ``RENDEZVOUS_WATCH_S``, then one of its own (dropped when the pair meets). A peer
    killed before the pair formed leaves this delegate in the Gloo rendezvous (blocked on the shared
    client, until its timeout) while the peer's replacement announces the next generation."""
    global _WATCH_STORE
    if _MET:  # the pair met after all: back to the shared client
        _WATCH_STORE = None
        return _STORE
    if _WATCH_STORE is None and waited_s > RENDEZVOUS_WATCH_S:
        from datetime import timedelta

        import torch.distributed as dist

        _WATCH_STORE = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False,
                                     timeout=timedelta(seconds=10))
    return _WATCH_STORE


def _parent_gone(spec: DelegateSpec) -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()  # the training process (also under a fork server)
    return not parent.is_alive() if parent is not None else os.getppid() != spec.parent_pid


def _watchdog(spec: DelegateSpec, stop, gen) -> None:
    """Exit when the transport closes, the training process dies, or the peer's replacement shows up
    under a newer generation (a Gloo op on a dead peer may not fail until its timeout: the training
    process restarts this delegate, which then meets the replacement)."""
    import multiprocessing

    parent = multiprocessing.parent_process()  # the training process (also under a fork server)
    last, started = 0.0, time.monotonic()
    while True:
        if stop.value:
            close_in_order()
        gone = not parent.is_alive() if parent is not None else os.getppid() != spec.parent_pid
        if gone:  # the training process died without closing: say so to the peer, unlink its ring
            if _HEARTBEAT is not None:
                _HEARTBEAT.bye(GONE)
            try:
                if _OP is not None:
                    _OP.unlink(spec.ring_name)
                else:  # still starting up: POSIX shm names live in /dev/shm on Linux
                    os.unlink(f"/dev/shm/{spec.ring_name}")
            except Exception:  # noqa: BLE001  (already gone)
                pass
            os._exit(0)
        now = time.monotonic()
        if now - last > 1.0:  # 1 Hz: idle queues poll too
            last = now
            try:
                store = _watch_store(spec, now - started)
                newer = f"{spec.prefix}/g{gen.value + 1}/up"
                if store is not None and store.check([newer]):
                    gen.value += 1
                    print(f"{spec.what()}: the peer was replaced (generation {gen.value}); exiting to be restarted",
                          file=sys.stderr, flush=True)
                    os._exit(PEER_LOST)
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending; stop/ppid decide)
                pass
        time.sleep(0.05)


def close_in_order() -> None:
    """Exit as the training process asked (``stop``): finish an acknowledgement being sent, say BYE."""
    got = _ACK_LOCK.acquire(timeout=ACK_GRACE_S)
    try:
        if _HEARTBEAT is not None:
            _HEARTBEAT.bye()
    finally:
        if got:
            _ACK_LOCK.release()
    os._exit(0)


# The points of a pair's exchange, in order, where ``fault_point`` can end or stall generation 0 (the
# tests force a restart at each of them).
SEND_POINTS = ("connect", "met", "held", "head", "body", "acked")
RECV_POINTS = ("connect", "met", "told", "head", "body", "written", "published", "ack")


def fault_point(spec: DelegateSpec, gen: int, point: str, msg: int | None = None) -> None:
    """Testing: if ``spec.fault_at`` = (point, message) names this point (and message, for the points
    of a message) and this delegate is of generation 0, die here as a SIGKILL would (no exit handler,
    no BYE); (point, message, seconds): stall here that long instead."""
    at = spec.fault_at
    if at is not None and gen == 0 and at[0] == point and (msg is None or at[1] == msg):
        if len(at) > 2:
            time.sleep(at[2])
        else:
            os.kill(os.getpid(), signal.SIGKILL)


class PeerLost(Exception):
    """The Gloo pair broke (the peer delegate died, or the connection went silent)."""


def _send(t, peer: int) -> None:
    import torch.distributed as dist

    dist.isend(t, dst=peer).wait(OP_WAIT)


def _recv(t, peer: int) -> None:
    import torch.distributed as dist

    dist.irecv(t, src=peer).wait(OP_WAIT)


def local_address(spec: DelegateSpec) -> str:
    """The address this delegate's Gloo connections leave from (``address_toward`` the job's store)."""
    return address_toward(spec.store_addr, spec.store_port)


def address_toward(store_addr: str, store_port: int) -> str:
    """The first IPv4 address of the interface Gloo was given (``GLOO_SOCKET_IFNAME``: the
    generation's interface, or the job's), else the address this host reaches the store from."""
    name = (os.environ.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if name:
        import psutil

        for a in psutil.net_if_addrs().get(name, []):
            if a.family == socket.AF_INET:
                return a.address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((store_addr, store_port))  # UDP: no packet is sent
        return s.getsockname()[0]


class _Heartbeat:
    """The pair's second TCP connection, between the generation's addresses. The kernels judge it
    (module docstring, Liveness): keep-alive probes and ``TCP_USER_TIMEOUT`` close it when the peer's
    host stops acknowledging for ``liveness_s``, the peer's kernel closes it when its process is gone.
    A closed or failed connection ends this delegate with ``PEER_LOST``, naming the interface, so that
    its training process restarts it as the next generation (next interface); a ``BYE`` first means
    the peer's training process closed it: the pair is over, not lost (``closed``)."""

    def __init__(self, spec: DelegateSpec, sock: socket.socket, stop, gen, connected_gen: int, where: str, ready):
        self.spec, self.sock, self.stop, self.gen, self.ready = spec, sock, stop, gen, ready
        self.connected_gen, self.where = connected_gen, where
        self.closed = threading.Event()  # the peer said BYE
        self._send_lock = threading.Lock()
        limit = spec.liveness()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, math.ceil(limit)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(limit * 1000)))

    def start(self) -> None:
        threading.Thread(target=self._guarded, daemon=True, name="pipemorph-heartbeat").start()

    def _guarded(self) -> None:
        """``_run``, but a heartbeat that fails in any way ends the delegate as a lost peer: a dead
        heartbeat thread would leave the pair's Gloo operations, which have no deadline, waiting."""
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - any failure of the beat is a failure of the pair
            self.lost(f"its heartbeat failed ({type(e).__name__}: {e})")

    def bye(self, word: bytes = BYE) -> None:
        """Tell the peer this end closes in order (``BYE``) or its rank died (``GONE``), before this
        process exits."""
        with self._send_lock:
            try:
                self.sock.setblocking(True)
                self.sock.settimeout(0.5)
                self.sock.sendall(word)
            except OSError:  # the peer is gone already
                pass

    def lost(self, why: str) -> None:
        if self.stop.value or _parent_gone(self.spec):  # stopped, or the watchdog is about to say GONE
            os._exit(0)
        g = self.gen.value = max(self.gen.value, self.connected_gen + 1)
        print(f"{self.spec.what()}: {why}{self.where}; exiting to meet its replacement as generation {g}",
              file=sys.stderr, flush=True)
        os._exit(PEER_LOST)

    def _run(self) -> None:
        period = self.spec.liveness() / BEATS_PER_LIVENESS
        sock = self.sock
        sock.setblocking(False)
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                with self._send_lock:
                    try:
                        sock.send(BEAT)
                    except BlockingIOError:  # the peer's buffer is full: its kernel acknowledged it all
                        pass
                    except OSError as e:
                        self.lost(f"its heartbeat connection failed ({e})")
                next_beat = now + period
            ready, _, _ = select.select([sock], [], [], max(0.0, min(next_beat - now, period)))
            if not ready:
                continue
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError as e:  # reset, or the kernel's user timeout / keep-alive gave up on the peer's host
                self.lost(f"its heartbeat connection failed ({e})")
            if BYE in data or GONE in data:
                self.ready.value = PEER_GONE if GONE in data else PEER_CLOSED
                self.closed.set()
                return
            if data == b"":
                self.lost("the peer closed its heartbeat connection")


class _Pair:
    """This delegate's end of the two-process Gloo group of one generation, and its heartbeat."""

    def __init__(self, spec: DelegateSpec, gen):
        self.spec, self.gen = spec, gen
        self.me = 0 if spec.role == "send" else 1
        self.peer = 1 - self.me

    def connect(self, stop, ready) -> None:
        """Form the Gloo group of the current generation, then the heartbeat connection between the
        same two addresses (the receiver listens, the sender connects once the group is formed)."""
        import torch.distributed as dist

        spec = self.spec
        store = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        self.connected_gen = self.gen.value
        prefix = f"{spec.prefix}/g{self.connected_gen}"
        store.set(f"{prefix}/up", str(os.getpid()))  # announces this generation to a stale peer
        fault_point(spec, self.connected_gen, "connect")
        iface = spec.interface(self.connected_gen)
        if iface is not None:  # Gloo reads it when the group is created (one group per process)
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        here = local_address(spec)
        listener = None
        if self.me == 1:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((here, 0))
            listener.listen(1)
            store.set(f"{prefix}/hb", f"{here} {listener.getsockname()[1]}")
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=self.me, world_size=2,
                                timeout=timedelta(seconds=spec.timeout_s))
        global _STORE, _MET, _HEARTBEAT
        _STORE, _MET = store, True
        fault_point(spec, self.connected_gen, "met")
        # The peer has formed the group too, so it listens or connects within moments (its kernel
        # accepts the connection even while the peer process waits for a CPU).
        setup_s = min(spec.timeout_s / 2, max(2 * spec.liveness(), 10.0))
        try:
            if listener is not None:
                listener.settimeout(setup_s)
                sock, _ = listener.accept()
                listener.close()
            else:
                host, port = store.get(f"{prefix}/hb").decode().split()
                sock = socket.create_connection((host, int(port)), timeout=setup_s, source_address=(here, 0))
        except OSError as e:
            raise PeerLost(f"no heartbeat connection within {setup_s:g} s ({e})") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        where = f" on interface {iface or os.environ.get('GLOO_SOCKET_IFNAME') or here}"
        _HEARTBEAT = _Heartbeat(spec, sock, stop, self.gen, self.connected_gen, where, ready)
        ready.value = 1  # before the heartbeat runs: it may set PEER_CLOSED at once
        _HEARTBEAT.start()


def delay_now_ms(spec: DelegateSpec, delays) -> float:
    """The injected delay of the link for the message about to leave: ``delays`` = (origin, static) as
    the training process last published them (``time.monotonic`` is one clock for every process)."""
    if delays is None:
        return 0.0
    origin, static = delays
    if spec.delays_trace is None:
        return static[spec.link]
    t0 = origin.value
    elapsed = 0.0 if math.isnan(t0) else max(0.0, time.monotonic() - t0)
    return spec.delays_trace.at(elapsed)[spec.link]


def run_sender(spec: DelegateSpec, op, pair: _Pair, acked, delays) -> None:
    """Pop pieces from the training process's ring, delay each message, send it, wait for its ack.

    The receiver first says which message of this queue its training process's ring already holds
    (``published``); re-pushed messages up to it are dropped here, unsent, and count as acknowledged."""
    import torch

    gen = pair.connected_gen
    ring = op.Ring.attach(spec.ring_name, spec.timeout_s)
    ack = torch.zeros(1, dtype=torch.int64)
    try:
        _recv(ack, pair.peer)
    except RuntimeError as e:
        raise PeerLost(str(e)) from e
    held = int(ack.item())
    fault_point(spec, gen, "held")
    while True:
        try:
            view, tag, seq = ring.begin_read(SLICE_S)
        except TimeoutError:
            continue
        msg, pieces, piece = split_tag(tag)
        if msg <= held:  # the receiving ring holds it already (its ack was lost with the old pair)
            ring.end_read(seq)
            if piece == pieces - 1:
                acked.value = msg
            continue
        if piece == 0:
            c = delay_now_ms(spec, delays)
            if c > 0:
                time.sleep(c / 1000.0)
        flat = view.reshape(-1).view(torch.uint8) if view.numel() else view
        try:
            _send(torch.tensor([flat.numel(), tag], dtype=torch.int64), pair.peer)
            fault_point(spec, gen, "head", msg)
            if flat.numel():
                _send(flat, pair.peer)
                if spec.release_pages:  # sent: its pages leave both processes (``staging.pages``)
                    release_pages(flat.data_ptr(), flat.numel())
            ring.end_read(seq)
            if piece == pieces - 1:
                fault_point(spec, gen, "body", msg)
                _recv(ack, pair.peer)
                fault_point(spec, gen, "acked", msg)
        except RuntimeError as e:  # the receiver delegate died: the training process re-sends what was not acked
            raise PeerLost(str(e)) from e
        if piece == pieces - 1:
            acked.value = msg


def run_receiver(spec: DelegateSpec, op, pair: _Pair, published) -> None:
    """Receive pieces into free slots of the training process's ring ahead of need; ack each message.

    ``published``: the last message of this queue whose last piece is in a ring of the training
    process (kept across generations); told to the sender first, then kept up to date. From the
    last piece's publication to its acknowledgement ``_ACK_LOCK`` is held: the training process may
    take the message and close at once, and the stop then waits for the ack to leave."""
    import torch

    gen = pair.connected_gen
    ring = op.Ring.attach(spec.ring_name, spec.timeout_s)
    desc = torch.zeros(2, dtype=torch.int64)
    ack = torch.ones(1, dtype=torch.int64)
    try:
        _send(torch.tensor([published.value], dtype=torch.int64), pair.peer)
        fault_point(spec, gen, "told")
        while True:
            _recv(desc, pair.peer)
            n, tag = (int(v) for v in desc.tolist())
            msg, pieces, piece = split_tag(tag)
            last = piece == pieces - 1
            fault_point(spec, gen, "head", msg)
            while True:  # the training process frees slots as it consumes; it may be busy for long
                try:
                    view, wseq = ring.begin_write(torch.uint8, [n], tag, SLICE_S)
                    break
                except TimeoutError:
                    continue
            try:
                if n:
                    _recv(view, pair.peer)
                if last:
                    fault_point(spec, gen, "body", msg)
            except BaseException:
                ring.abort_write(wseq)
                raise
            if not last:
                ring.end_write(wseq)
                continue
            with _ACK_LOCK:
                ring.end_write(wseq)
                fault_point(spec, gen, "written", msg)
                published.value = msg
                fault_point(spec, gen, "published", msg)
                _send(ack, pair.peer)
            fault_point(spec, gen, "ack", msg)
    except RuntimeError as e:  # the sender delegate died: its replacement re-sends what was not acked
        raise PeerLost(str(e)) from e


def main(spec: DelegateSpec, gen, stop, acked, ready, delays=None) -> None:
    """Entry point of the spawned process; ``ready`` is set once the pair's group is formed (``PEER_CLOSED``
    once the peer closed in order); ``delays`` (sender only) = (origin, static delays) shared with the
    training process; ``acked``: a sender's last acknowledged message, a receiver's last published one
    (``run_receiver``).

    Exit codes: 0 stop or parent gone, ``PEER_LOST`` the pair broke (``gen`` = generation to meet
    next), 1 anything else (printed). The training process restarts a delegate that exited non-zero.
    A Ctrl-C reaches the whole foreground process group, delegates included: they ignore it, and
    their training process stops them (or they see it gone).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watchdog, args=(spec, stop, gen), daemon=True, name="pipemorph-watchdog").start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    global _OP
    op = _OP = _load_op(spec.op_name, spec.op_path)
    pair = _Pair(spec, gen)
    pair.connected_gen = gen.value
    try:
        pair.connect(stop, ready)
        if spec.role == "send":
            run_sender(spec, op, pair, acked, delays)
        else:
            run_receiver(spec, op, pair, acked)
    except PeerLost as e:
        hb = _HEARTBEAT
        # The Gloo connection closed: did the peer close in order (BYE comes before its connection
        # closes), or is it lost? The heartbeat thread decides (it exits the process if lost).
        if hb is not None and hb.closed.wait(ACK_GRACE_S):
            while True:  # the pair is over; stay until the training process stops this delegate
                time.sleep(1.0)
        if stop.value or _parent_gone(spec):
            os._exit(0)
        g = gen.value = max(gen.value, pair.connected_gen + 1)
        print(f"{spec.what()}: peer lost ({first_line(e) or 'closed'}); "
              f"exiting to meet its replacement as generation {g}", file=sys.stderr, flush=True)
        os._exit(PEER_LOST)
    except Exception as e:  # noqa: BLE001
        if not stop.value and not _parent_gone(spec):
            print(f"{spec.what()} failed: {first_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)
