"""Start N ranks of a script on this host, forked from one process that has already imported what
every rank imports (torch, DeepSpeed, the package), as ``torchrun --standalone`` would start them.

    python tests/runtime/forkrun.py N SCRIPT [ARGS...]

Each rank of a torchrun job imports all of that itself: about 2.5 s of CPU per rank on this 2-core
machine, for every job the tests start. Forked ranks share the imported modules and start training at
once. What torchrun itself does (its rendezvous, restarts, its exit report) is tested through torchrun
and the deepspeed launcher elsewhere; the tests that read its report launch with it.

As torchrun's agent: this process hosts the job's TCP store on a port it holds from before the ranks
start (``TORCHELASTIC_USE_AGENT_STORE``: no rank races another process for it), and gives each rank
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``TORCHELASTIC_RESTART_COUNT``; ``OMP_NUM_THREADS=1`` unless set. The first rank to fail, or a SIGTERM,
SIGINT or SIGHUP to this process, ends the others (the signal, then SIGKILL after ``KILL_AFTER_S``).
The exit code is 0 when every rank exited 0, else 1, with one line per failed rank on stderr
(``rank R exited with code C``).

A rank runs the script as ``__main__``; an exception that escapes it goes to ``sys.excepthook`` (the
package's own, once ``ds_pipemorph.initialize`` installed it). It then ends as the interpreter ends a
script (its threads joined, its atexit handlers run: the package's shutdown) but without tearing down
the objects it inherited: freeing them would touch, and so copy, every page of this process's heap."""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import runpy
import signal
import socket
import sys
import threading
import time

KILL_AFTER_S = 30.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _warm() -> None:
    """Import what the ranks import, and ask what every rank asks DeepSpeed first, here once."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (every optimizer's first construction imports it)
    import deepspeed
    import deepspeed.ops
    import ds_pipemorph.runtime.engine  # noqa: F401

    deepspeed.ops.__compatible_ops__  # the ops DeepSpeed can build: probed with the compiler, kept per process


def _exit(code: int) -> None:
    """End as the interpreter ends a script, without its last teardown; never returns."""
    try:
        threading._shutdown()  # what the interpreter runs first at exit: its threads' own hooks, then joins
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank(rank: int, world: int, port: int, listener: int, script: str, args: list[str]) -> None:
    """In the forked child: run ``script`` as ``__main__`` as rank ``rank``; never returns."""
    os.close(listener)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    script_globals = None  # held through the exit below, as the interpreter holds ``__main__`` through its own
    try:
        script_globals = runpy.run_path(script, run_name="__main__")  # noqa: F841
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # as the interpreter does: the message on stderr, exit code 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _listen() -> socket.socket:
    """A socket on a free port of this host, listening from now on: the job's store is served on it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: forkrun.py N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    world, script, args = int(argv[0]), argv[1], argv[2:]
    _warm()
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, \
        "a thread started while importing: the ranks would fork without it"
    sock = _listen()
    port, listener = sock.getsockname()[1], sock.detach()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the ranks' collections then never walk, and so never copy, what they inherit

    ranks: dict[int, int] = {}
    deadline = None  # when the ranks still running get SIGKILL

    def stop(sig) -> None:
        nonlocal deadline
        for pid in list(ranks):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if deadline is None:
            deadline = time.monotonic() + KILL_AFTER_S

    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # no signal between two forks, none before the handlers
    try:
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                try:
                    _rank(rank, world, port, listener, script, args)
                finally:
                    os._exit(1)  # never back into this loop
            ranks[pid] = rank
        import torch.distributed as dist

        # Served by a thread of this process, started while the signals are held: that thread never takes
        # one, the main thread's handlers below do.
        store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(minutes=30),  # noqa: F841
                              wait_for_workers=False, master_listen_fd=listener)
    except BaseException:
        stop(signal.SIGKILL)
        raise
    for sig in SIGNALS:
        signal.signal(sig, lambda sig, _frame: stop(sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)

    failed: dict[int, int] = {}
    while ranks:  # polled, so that a deadline set by a signal is kept while every rank still runs
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                stop(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed[rank] = code
            if deadline is None:  # the first failure ends the rest, as torchrun's does
                stop(signal.SIGTERM)
    for rank, code in sorted(failed.items()):
        print(f"rank {rank} exited with code {code}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
