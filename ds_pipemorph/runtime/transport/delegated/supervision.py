"""Starting, watching and restarting the delegate processes of a delegated transport (PipeMorph §5.2, §5.3).

Delegates come from a fork server that preloaded torch and the delegate code (``delegate_context``), so a
link switched to the delegates at an iteration boundary starts in a fraction of a second once the server
is up; the server starts at ``prepare`` or ``prewarm`` (see ``prepare`` for when). Per link
direction this rank uses, one delegate per queue is spawned with a fresh staging ring; a direction is
started on first use or by ``start_link`` and can grow more queues. Every wait of the transport calls
``_health``: a delegate that exited (its peer died, or it was killed) is restarted as the next
generation of its pair (both ends meet again under that generation, on the next network interface of
``delegation.interfaces`` if several are given), and a sender's unacknowledged messages are pushed again.
A pair whose connection goes silent (a downed interface) is lost within about ``liveness_s`` by its
heartbeat connection (``delegate_proc``: judged by the kernels, so a slow peer is never lost), so the
restart and the re-sent messages land well within the training process's ``timeout_s``, which is the
one deadline of its waits.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from multiprocessing import spawn

import torch.multiprocessing as mp

from ..protocol import TransportError, TransportTimeout, directions_on, link_of
from .delegate_proc import PEER_LOST, DelegateSpec, interface_for
from .delegate_proc import main as delegate_main
from .directions import DelegateQueue, Direction

log = logging.getLogger("ds_pipemorph.delegated")
DELEGATE_MODULE = "ds_pipemorph.runtime.transport.delegated.delegate_proc"  # what the fork server preloads


def delegate_context():
    """Where delegates come from: a fork server that has imported torch and the delegate code once,
    so a delegate starts in a fraction of a second instead of importing torch afresh (seconds, tens
    of seconds on a loaded host: too long to switch a slow link at an iteration boundary). Each
    delegate is still a fresh fork of a process that never ran CUDA or training threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", DELEGATE_MODULE])
    short_socket_folder()
    return ctx


_SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX socket's path (Linux's ``sun_path``, less its final zero)
_LISTENER = "/pymp-xxxxxxxx/listener-xxxxxxxx"  # what multiprocessing adds to the temporary folder
_SHORT_FOLDERS = ("/tmp", "/var/tmp", "/usr/tmp")  # where a folder for the socket goes instead
_SHORTENING = threading.Lock()


def short_socket_folder() -> None:
    """The fork server listens on a socket that multiprocessing makes in a folder of its own in the
    temporary folder; where ``TMPDIR`` is long (a scheduler's job folder) that path is too long for
    a socket and every delegate start fails ("AF_UNIX path too long"). Before multiprocessing has
    made its folder, a long temporary folder gets one in the first writable of ``/tmp``,
    ``/var/tmp``, ``/usr/tmp`` instead (as newer Pythons do themselves), removed at exit as
    multiprocessing removes its own (a rank killed outright leaves it there, as it leaves its own)."""
    import shutil
    import tempfile
    from multiprocessing import process, util

    with _SHORTENING:
        config = process.current_process()._config
        if config.get("tempdir") is not None:
            return
        if len(os.fsencode(tempfile.gettempdir())) + len(_LISTENER) <= _SOCKET_PATH_MAX:
            return
        for base in _SHORT_FOLDERS:
            if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
                folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
                util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
                config["tempdir"] = folder
                _MADE[os.getpid()] = folder
                return


_MADE: dict = {}  # pid -> multiprocessing's folder this process made (``short_socket_folder``, ``watch_socket_folder``)


def watch_socket_folder() -> None:
    """Tell this process's reaper the folder multiprocessing keeps the fork server's socket in (made
    now if there is none yet), so that it goes however the process ends: multiprocessing removes it
    at a normal exit only, and a rank its launcher terminates or ``kill -9`` kills would leave it
    behind. Only a folder this process made: a process multiprocessing started inherits its
    parent's setting, and the folder is the parent's, in use by the parent and its other children;
    one made by other code of this process before is that code's."""
    from multiprocessing import process, util

    from ... import reaper

    short_socket_folder()
    with _SHORTENING:
        if process.current_process()._config.get("tempdir") is None:
            _MADE[os.getpid()] = util.get_temp_dir()
        folder = _MADE.get(os.getpid())
    if folder is not None:
        reaper.watch(folder)


_HIDING = threading.RLock()


@contextlib.contextmanager
def main_module_hidden():
    """Start a delegate without re-running the training script in it: multiprocessing tells every
    spawned or fork-server child which main module to import (``spawn.get_preparation_data``), and a
    training script without an ``if __name__ == "__main__"`` guard would then start training again
    inside the delegate. The delegate needs only this package, so the children started here are told
    of no main module. Only that one function is wrapped, and only while a delegate (or the fork
    server) starts: ``sys.modules["__main__"]`` stays as it is, so other threads may pickle the
    script's objects meanwhile (a first start waits seconds for the fork server to import torch)."""
    with _HIDING:  # one at a time: a restart on a receive thread and a prewarm would undo each other
        real = spawn.get_preparation_data

        def without_main(name):
            data = real(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            spawn.get_preparation_data = real


class Supervision:
    """Part of ``DelegatedTransport``: its delegates' life cycle (the state is the transport's, see its
    ``__init__``; a restart pushes messages again through ``Sending._push``)."""

    def prepare(self, start_server: bool = True) -> None:
        """Build (or load from the cache) the staging op now, and with ``start_server`` start the fork
        server too, so that the first link switched to the delegates waits for neither: a first JIT
        build takes tens of seconds, the fork server imports torch (seconds, tens of seconds on a
        loaded host). Only the op variant this transport's device needs is built. A failed build is
        logged and raised again when a link first goes delegated (a job whose links all stay direct
        does not need the op).

        Without ``start_server`` nothing runs beside training until a link may need the delegates:
        ``prewarm`` (the control loop calls it at the first slow observation of a link) or the first
        delegated link starts the server. Importing torch in it takes a core for seconds, which a job
        whose links stay direct should not pay in its first iterations."""
        from ....staging.ring import op_builder
        from ... import reaper

        reaper.watch()  # this process's rings are removed however it ends
        reaper.reclaim_orphans()  # and those of processes that ended before there was a reaper

        from ....staging.builder import announce_build

        builder = op_builder(cuda=self.staging_path.cuda)
        announce_build(builder, "the staging ring op for delegated links")  # only when it really compiles
        try:
            self._load_op()
        except Exception as e:  # noqa: BLE001  (raised again by _load_op at the first delegated link)
            log.warning("rank %d: cannot build the staging op %s (%s); a link switched to the delegates "
                        "will fail", self.rank, builder.name, e)
        if start_server:
            self.prewarm()

    def prewarm(self) -> None:
        """Start the fork server if it is not running (returns at once: the server imports torch and
        the delegate code in its own process, and the first delegate forked waits for that)."""
        from multiprocessing import forkserver

        watch_socket_folder()
        with main_module_hidden():
            forkserver.ensure_running()

    # -- delegates ----------------------------------------------------------------------------
    def _load_op(self):
        if self._op is None:
            from ....staging.ring import load_op

            self._op = load_op(cuda=self.staging_path.cuda)
        return self._op

    def _rendezvous_prefix(self, link: int, kind: str, q: int) -> str:
        """Where the two delegates of a queue meet in the job's store: named by the global ranks at
        the link's ends, so that the same link of every data-parallel replica meets on its own."""
        a, b = self.stage_ranks[link], self.stage_ranks[link + 1]
        return f"pipemorph/delegates/{self.session}/R{a}-{b}{kind}/q{q}"

    def _spawn(self, link: int, kind: str, sending: bool, q: int, gen_value: int, stop=None, acked_from: int = -1):
        from ....staging.ring import StagingRing
        from ... import reaper

        reaper.watch()  # started by ``prepare`` already, unless this transport was not prepared
        watch_socket_folder()  # the fork server's, started by ``prewarm`` or by this spawn
        op = self._load_op()
        try:
            ring = StagingRing.create(self._ring_name(link, kind, sending, q, gen_value),
                                      slot_bytes=self.slot_bytes, num_slots=self.num_slots, op=op)
        except op.StagingNoRoomError as e:  # /dev/shm has no room for the ring
            raise TransportError(f"rank {self.rank}: link {link}: {e}; or lower ds_config "
                                 f"pipemorph.delegation.slot_mb / slots") from None
        self.staging_path.pin(ring)  # CUDA: page-lock it now, at link start, not inside the first copy
        gen = self._ctx.Value("q", gen_value, lock=False)  # single writer: the delegate
        stop = stop if stop is not None else self._ctx.Value("b", 0, lock=False)  # single writer: this process
        acked = self._ctx.Value("q", acked_from, lock=False)  # set before the delegate starts: it reads it at once
        ready = self._ctx.Value("b", 0, lock=False)
        spec = DelegateSpec(
            role="send" if sending else "recv", rank=self.rank, link=link, kind=kind, queue=q,
            ring_name=ring.name, op_name=op.__name__, op_path=op.__file__, store_addr=self.store_addr,
            store_port=self.store_port,
            prefix=self._rendezvous_prefix(link, kind, q),
            parent_pid=os.getpid(), timeout_s=self.timeout_s,
            delays_trace=self.delays.trace if (sending and self.delays is not None) else None,
            interfaces=self.interfaces, liveness_s=self.liveness_s, fault_at=self.fault_at.get("send" if sending else "recv"),
            release_pages=self.fit_ring)
        delays = self._delay_state() if sending else None
        proc = self._ctx.Process(target=delegate_main, args=(spec, gen, stop, acked, ready, delays), daemon=True,
                                 name=f"pipemorph-{spec.role}-L{link}{kind}q{q}")
        with main_module_hidden():
            proc.start()
        return ring, proc, gen, stop, acked, ready

    def _direction(self, kind: str, sending: bool) -> Direction:
        link = link_of(self.stage_id, kind, sending)
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
                    queues.append(DelegateQueue(q, ring, proc, gen, stop, acked, ready))
                d = self._dirs[key] = Direction(link, kind, sending, queues, active=active)
        return d

    def start_link(self, link: int, queues: int | None = None) -> None:
        """Start the delegates of every direction this rank uses on ``link`` (idempotent), with
        ``queues`` FIFOs per direction in use (default: the transport's). A direction starts
        ``max_queues`` delegates at once; asking for more queues than a running direction uses
        spreads messages from the next one on over more of them (starting more delegates beside
        the running ones only beyond ``max_queues``; nothing restarts): call it on both ends at the
        same iteration boundary, when the receiver has taken every message sent so far. A
        direction never shrinks (idle queues cost an idle process and untouched shared memory)."""
        keys = directions_on(self.stage_id, link)
        if not keys:
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

    def _grow(self, d: Direction, queues: int) -> None:
        """Add delegates to a running direction so that it has ``queues``; both ends switch the
        mapping of messages to queues at the same message (the next one), which they agree on
        because the receiver holds everything sent so far. Messages already in a queue stay there
        (a restart after a delegate dies re-sends them into the same queue)."""
        if not d.sending and (d.stash or d.partial or d.busy):
            raise TransportError(f"rank {self.rank}: link {d.link} {d.kind}: cannot add delegate queues while "
                                 f"received messages wait to be taken (call it at an iteration boundary)")
        for q in range(len(d.queues), queues):
            ring, proc, gen, stop, acked, ready = self._spawn(d.link, d.kind, d.sending, q, 0)
            d.queues.append(DelegateQueue(q, ring, proc, gen, stop, acked, ready))
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

    def _check_alive(self, d: Direction, q: DelegateQueue, what: str) -> bool:
        """Restart the delegate of ``q`` if it died; True if it did. Never once the transport is
        closed or killed (``kill``: the process is being stopped, its delegates with it)."""
        if self._closed or q.proc.is_alive():
            return False
        self._restart(d, q, what)
        return True

    def _restart(self, d: Direction, q: DelegateQueue, what: str) -> None:
        old_pid, old_code = q.proc.pid, q.proc.exitcode
        # The next generation, whatever the exit. Not ``gen.value + 1``: a delegate that failed just
        # after its watchdog had moved ``gen`` on (or after PEER_LOST set it) would skip one, and the
        # two ends would then wait for each other in different generations.
        gen = q.born + 1
        # The old delegate is gone: what it last recorded (the sender's last acknowledged message, the
        # receiver's last published one) is final, and the replacement starts from it.
        ring, proc, genv, _, acked, ready = self._spawn(d.link, d.kind, d.sending, q.index, gen, stop=q.stop,
                                                        acked_from=q.acked.value)
        if d.sending:
            q.ring.close()
            q.ring, q.proc, q.gen, q.acked, q.ready, q.born = ring, proc, genv, acked, ready, gen
            resend = list(q.unacked)
            for m in resend:  # in order; the new sender delegate drops those the receiving ring holds
                self._push(d, q, m)
        else:
            q.old_rings.append(q.ring)
            q.ring, q.proc, q.gen, q.acked, q.ready, q.born = ring, proc, genv, acked, ready, gen
            resend = []
        why = "lost its peer" if old_code == PEER_LOST else f"died (exit code {old_code})"
        line = (f"rank {self.rank}: link {d.link}: {'sender' if d.sending else 'receiver'} delegate of "
                f"{d.kind} queue {q.index} (pid {old_pid}) {why} while {what}; restarted it "
                f"as generation {gen}" + (f" on interface {interface_for(self.interfaces, gen)}"
                                          if self.interfaces else "")
                + (f" and re-sent {len(resend)} unacknowledged messages" if d.sending else ""))
        self.events.append(line)
        log.warning(line)
