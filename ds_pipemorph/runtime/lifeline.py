"""A training process's lifeline: a dead rank is named, a signal or a failure stops the job, in seconds.

One per process (``start``; ``ds_pipemorph.initialize`` starts it once the engine is built). Each rank
listens on a TCP port published in the job's store (``pipemorph/life/<attempt>/<rank>``: address, port,
pid, host) and keeps a connection to each of its pipeline neighbours (the lower rank connects). A
thread (``_watch``) waits on all of them, on the signal pipe and, once a second, on the store's
``ended`` key. What it concludes is the kernels', never a guess from how fast a peer runs:

- a neighbour's connection closed without ``BYE``: its process is gone (its kernel closed every socket
  it had). The rank that sees it first says so in one sentence, ``error: rank 2 (stage 2, pid 812 on
  node2) died``, writes it as the job's end in the store, and stops; a neighbour's kernel that stops
  acknowledging (its host or the network to it down) ends only the connection after
  ``USER_TIMEOUT_S`` and is told apart (``unreachable``): a link down between two live ranks still
  fails over (``runtime.transport.router`` asks ``peer_gone`` before it fails over), and the job
  stops only once the neighbour stayed unreachable ``timeout_s`` + ``USER_TIMEOUT_S`` (by then the
  transport's own waits have timed out naming their links, unless this rank waits in a collective);
- SIGINT or SIGTERM to this process (a Ctrl-C, a launcher passing its signal on): the first rank to
  get one prints ``rank 1: stopped by SIGINT``, writes the job's end and stops with 128 + the
  signal's number, without waiting for the training thread (it may wait inside a collective);
- the job's end written by another rank: stop without a line (that rank printed it);
- this process's parent gone (its launcher killed with SIGKILL: the process was handed to another
  parent): stop, ``rank 1: stopping: its launcher (pid 4242) is gone``;
- this rank cut off: every neighbour unreachable and the store not answering for ``USER_TIMEOUT_S``
  (this host's network is down): stop with a sentence, instead of waiting in a collective whose
  deadline is DeepSpeed's (30 min); the other ranks meet their own timeouts, naming their links;
- a failure of this process (``fail``: an uncaught error, ``runtime.errors``): ``FAIL`` to the
  neighbours and the job's end in the store, so that every other rank stops within a second or two
  instead of at its own timeout.

Stopping runs the registered ``cleanups`` (the delegated transports kill their delegates and unlink
their rings, the CPU all-reduce buffer is removed), flushes and ``os._exit``s: the training thread may
hold any lock. A process that ends in order says ``BYE`` to its neighbours (``close``, at exit).
"""
from __future__ import annotations

import atexit
import errno
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from .transport.delegated.delegate_proc import address_toward

POLL_S = 1.0  # the store's ``ended`` key and the neighbours not yet connected are looked at this often
USER_TIMEOUT_S = 10.0  # a neighbour's kernel silent this long: its host or the network to it is down
STORE_S = 3.0  # a store call on the way out waits at most this long (its host may be gone)
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_current: Lifeline | None = None
_lock = threading.Lock()


def current() -> Lifeline | None:
    return _current


def _attempt() -> str:
    """Keys of one launch attempt: torchrun restarts a failed job with the same store."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _judged_by_kernel(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, int(USER_TIMEOUT_S))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(USER_TIMEOUT_S * 1000))


class Lifeline:
    """See the module docstring. ``stage_of``: global rank -> stage, for the sentences."""

    def __init__(self, rank: int, store_addr: str, store_port: int, stage_of: dict[int, int] | None = None):
        import torch.distributed as dist
        from datetime import timedelta

        self.rank, self.stage_of = rank, dict(stage_of or {})
        self.prefix = f"pipemorph/life/{_attempt()}"
        self.ended_key = f"{self.prefix}/ended"
        self.store = dist.TCPStore(store_addr, store_port, is_master=False, timeout=timedelta(seconds=60))
        self.store.set_timeout(timedelta(seconds=5))  # later calls: the thread must stay free to stop the process
        addr = address_toward(store_addr, store_port)
        self.listener = socket.create_server((addr, 0), backlog=64)
        self.store.set(f"{self.prefix}/{rank}", f"{addr} {self.listener.getsockname()[1]} {os.getpid()} "
                                                f"{socket.gethostname()}")
        self.cleanups: list[Callable[[], None]] = []
        self.conns: dict[socket.socket, dict] = {}  # connection -> {rank, buf, bye}
        self.pending: set[int] = set()  # neighbours to connect to, once they published their port
        self.peers: dict[int, str] = {}  # rank -> "pid P on HOST" once known
        self.unreachable: dict[int, float] = {}  # rank -> when its kernel last answered
        self.unreachable_s = 300.0 + USER_TIMEOUT_S  # ``set_timeout``
        self.dead: set[int] = set()
        self.failure: str | None = None  # set by ``fail``: what the neighbours hear at exit
        self._stopping = False
        self._closed = False
        self.ppid = os.getppid()
        self._store_lost_at: float | None = None  # the store stopped answering then
        self._guard = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._old_handlers: dict = {}
        self._thread = threading.Thread(target=self._watch, daemon=True, name="pipemorph-lifeline")
        self._thread.start()
        atexit.register(self.close)

    # -- set-up ---------------------------------------------------------------------------------------
    def watch_neighbours(self, ranks: Sequence[int], stage_of: dict[int, int] | None = None,
                         wait_s: float = 60.0) -> None:
        """Keep a connection to each of ``ranks`` (this rank connects to the higher ones, now: each
        publishes its port as its engine is built, at about the same time as this one; one not there
        within ``wait_s`` is connected to later, by the lifeline's thread)."""
        with self._guard:
            self.stage_of.update(stage_of or {})
            known = {c["rank"] for c in self.conns.values()}
            new = [r for r in ranks if r > self.rank and r not in known]
            self.pending.update(new)
        deadline = time.monotonic() + wait_s
        for r in new:
            key = f"{self.prefix}/{r}"
            # Short checks, not one long wait: the store client serves one call at a time, and the
            # lifeline's thread shares it.
            try:
                while not self.store.check([key]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.store.check([key]):
                    self._connect(r, self.store.get(key).decode())
            except Exception:  # noqa: BLE001  (not there yet: the thread tries again every POLL_S)
                pass

    def catch_signals(self) -> bool:
        """Stop on SIGINT/SIGTERM from the lifeline's thread (the training thread may be inside a C++
        wait that a Python handler would never interrupt). Main thread only; a signal the program
        handles itself, or a wakeup fd someone else set, is left alone. True if installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        mine = [s for s in SIGNALS if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler)]
        if not mine:
            return False
        old_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        if old_fd != -1:  # someone else's (an event loop): theirs stays
            signal.set_wakeup_fd(old_fd)
            return False
        for s in mine:
            self._old_handlers[s] = signal.signal(s, _noted)
        return True

    def set_timeout(self, timeout_s: float) -> None:
        """The engine's ``timeout_s``: a neighbour unreachable this long (plus ``USER_TIMEOUT_S``) ends the job."""
        self.unreachable_s = float(timeout_s) + USER_TIMEOUT_S

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when this process stops by the lifeline (lock-free work: the training thread may hold any)."""
        self.cleanups.append(fn)

    # -- what the training process asks -------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """The lifeline is ending this process (its thread exits it in a moment)."""
        return self._stopping

    def peer_gone(self, rank: int, within_s: float = 0.5) -> bool:
        """Second opinion before a link is failed over: True if ``rank``'s process is gone (this
        process is then stopping, naming it). Waits up to ``within_s`` for its kernel's word: a
        process that exits closes every socket at once, its connections' ends arrive together."""
        deadline = time.monotonic() + within_s
        while True:
            if self._stopping:
                return True
            with self._guard:
                open_ = any(v["rank"] == rank for v in self.conns.values())
                if not open_ and rank not in self.pending:
                    return rank in self.dead
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def settle(self, within_s: float) -> bool:
        """Wait up to ``within_s`` for the lifeline to read what its neighbours said or how their
        connections ended (an error of the training thread may be the first sign of a neighbour's death
        or stop, whose word is being read now); True if the lifeline is stopping the process."""
        deadline = time.monotonic() + within_s
        while not self._stopping and time.monotonic() < deadline:
            with self._guard:
                conns = list(self.conns)
            try:
                unread = select.select(conns, [], [], 0)[0] if conns else []
            except (OSError, ValueError):  # a connection closed meanwhile: look again
                unread = [None]
            if not unread and not self.dead:
                break
            time.sleep(0.02)
        return self._stopping

    def claim_end(self, sentence: str) -> bool:
        """This process is failing with ``sentence``: tell the job (the others stop at once). True if
        it is the first end of the job (then this process prints the sentence; else another did)."""
        self.failure = sentence
        return self._announce(sentence)

    fail = claim_end

    def close(self) -> None:
        """An orderly end: BYE (or FAIL after ``fail``) to the neighbours; the thread ends and is joined,
        and the store client goes, before the interpreter's teardown (a thread still inside the
        store's C++ then would end the process with "terminate called without an active exception")."""
        with self._guard:
            if self._closed or self._stopping:
                return
            self._closed = True
            conns = list(self.conns)
        word = b"FAIL\n" if self.failure else b"BYE\n"
        for c in conns:
            try:
                c.sendall(word)
            except OSError:
                pass
        try:
            for s, h in self._old_handlers.items():
                signal.signal(s, h)
            if self._old_handlers:
                signal.set_wakeup_fd(-1)
        except (ValueError, TypeError):  # not the main thread at exit
            pass
        os.write(self._wake_w, b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        for c in [*conns, self.listener]:
            c.close()
        self.store = None  # the store client goes now, not in the interpreter's teardown

    # -- the thread -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        last = 0.0
        while not self._closed:
            with self._guard:
                socks = [self.listener, self._wake_r, *self.conns]
            try:
                ready, _, _ = select.select(socks, [], [], POLL_S)
            except (OSError, ValueError):
                continue  # a connection closed meanwhile
            for s in ready:
                if s is self.listener:
                    self._accept()
                elif s == self._wake_r:
                    self._signals()
                else:
                    self._judge(s)
            if time.monotonic() - last >= POLL_S:
                last = time.monotonic()
                if os.getppid() != self.ppid:
                    first = self._announce(f"the launcher of rank {self.rank} (pid {self.ppid}) is gone")
                    line = f"rank {self.rank}: stopping: its launcher (pid {self.ppid}) is gone"
                    self._stop(1, line if first else None, own=True)
                self._poll_store()
                self._judge_unreachable()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        _judged_by_kernel(conn)
        with self._guard:
            self.conns[conn] = dict(rank=None, buf=b"", bye=False)

    def _connect(self, rank: int, info: str) -> None:
        addr, port, pid, host = info.split()
        self.peers[rank] = f"pid {pid} on {host}"
        try:
            conn = socket.create_connection((addr, int(port)), timeout=5.0)
            conn.sendall(f"HELLO {self.rank} {os.getpid()} {socket.gethostname()}\n".encode())
        except OSError:
            return  # tried again at the next poll
        _judged_by_kernel(conn)
        conn.settimeout(None)
        with self._guard:
            self.pending.discard(rank)
            self.conns[conn] = dict(rank=rank, buf=b"", bye=False)

    def _poll_store(self) -> None:
        try:
            self._poll_store_once()
            self._store_lost_at = None
        except Exception:  # noqa: BLE001  (the store's host is gone, or this host's network)
            now = time.monotonic()
            self._store_lost_at = self._store_lost_at or now
            with self._guard:
                cut_off = bool(self.unreachable) and not self.conns
            if cut_off and now - self._store_lost_at >= USER_TIMEOUT_S:
                self._stop(1, f"rank {self.rank}: stopping: cut off from the job (neither the job's store nor any "
                              f"neighbour has answered for {USER_TIMEOUT_S:g} s: this host's network is down)",
                           own=True)

    def _poll_store_once(self) -> None:
        store = self.store
        if store is None:  # closed meanwhile
            return
        if self.failure is None and store.check([self.ended_key]):
            self._stop(1, None)
        with self._guard:
            pending = sorted(self.pending)
        for r in pending:
            key = f"{self.prefix}/{r}"
            if store.check([key]):
                self._connect(r, store.get(key).decode())

    def _judge_unreachable(self) -> None:
        for rank, since in list(self.unreachable.items()):
            if time.monotonic() - since >= self.unreachable_s:
                sentence = (f"{self._who(rank)} has been unreachable for {self.unreachable_s:g} s: its host or "
                            f"the network to it is down; the job stops")
                first = self._announce(sentence)
                self._stop(1, f"error: {sentence}" if first else None, own=True)

    def _who(self, rank: int) -> str:
        stage = self.stage_of.get(rank)
        inner = ", ".join(x for x in (f"stage {stage}" if stage is not None else "", self.peers.get(rank, "")) if x)
        return f"rank {rank}" + (f" ({inner})" if inner else "")

    def _signals(self) -> None:
        data = os.read(self._wake_r, 64)
        for b in data:
            if b in SIGNALS:
                name = signal.Signals(b).name
                first = self._announce(f"rank {self.rank} was stopped by {name}")
                self._stop(128 + b, f"rank {self.rank}: stopped by {name}" if first else None, own=True)

    def _judge(self, conn: socket.socket) -> None:
        """Read what a neighbour said, or conclude from its connection's end."""
        with self._guard:
            state = self.conns.get(conn)
        if state is None:
            return
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError as e:  # reset: the process is gone; timed out: its host or the network is down
            data = None if e.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH) else b""
        if data:
            state["buf"] += data
            *lines, state["buf"] = state["buf"].split(b"\n")
            for line in lines:
                word, *rest = line.decode(errors="replace").split()
                if word == "HELLO":
                    state["rank"] = int(rest[0])
                    self.peers[state["rank"]] = f"pid {rest[1]} on {rest[2]}"
                elif word == "BYE":
                    state["bye"] = True
                elif word in ("FAIL", "STOP"):
                    self._stop(1, None)  # the failing or stopped rank told the job
            return
        with self._guard:
            self.conns.pop(conn, None)
        conn.close()
        rank = state["rank"]
        if state["bye"] or rank is None:
            return
        if data is None:
            self.unreachable[rank] = time.monotonic() - USER_TIMEOUT_S
            return
        self.dead.add(rank)
        sentence = f"{self._who(rank)} died: its process is gone; the job stops"
        first = self._announce(sentence)
        self._stop(1, f"error: {sentence}" if first else None)

    def _announce(self, sentence: str) -> bool:
        """Write the job's end once (the first writer wins); True if this process wrote it (or the
        store cannot say: then this process speaks for itself)."""
        result: list = []

        mine = f"{self.rank}|{sentence}"  # two ranks may say the same sentence: only one is first

        def put():
            try:
                result.append(self.store.compare_set(self.ended_key, "", mine).decode() == mine)
            except Exception:  # noqa: BLE001
                result.append(True)

        t = threading.Thread(target=put, daemon=True)
        t.start()
        t.join(STORE_S)
        return result[0] if result else True

    def _stop(self, code: int, line: str | None, own: bool = False) -> None:
        """Stop the process (``own``: for a cause of its own: a signal). A process failing by itself
        (``claim_end``) is left to finish: its training thread exits, and prints only if its own
        word was the job's first; so when this thread's word came first (``line``), it prints it here:
        the training thread's error may be the dead neighbour's first sign, and its word then lost."""
        if self.failure is not None and not own:
            if line:
                print(line, file=sys.stderr, flush=True)
            return
        with self._guard:
            if self._stopping:
                return
            self._stopping = True
            conns = list(self.conns)
        if line:
            print(line, file=sys.stderr, flush=True)
        for c in conns:
            try:
                c.sendall(b"STOP\n")
            except OSError:
                pass
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception:  # noqa: BLE001  (stopping anyway)
                pass
        from .shutdown import flush_all

        flush_all()
        os._exit(code)


def _noted(signum, frame) -> None:
    """The Python-level handler: the lifeline's thread acts on the signal (through the wakeup fd)."""


def _peek_closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def start(rank: int, store_addr: str, store_port: int, stage_of: dict[int, int] | None = None) -> Lifeline:
    """This process's lifeline (made once; later calls return it)."""
    global _current
    with _lock:
        if _current is None:
            _current = Lifeline(rank, store_addr, store_port, stage_of)
        return _current
