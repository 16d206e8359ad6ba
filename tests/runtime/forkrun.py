"""Start N ranks of a script on this host, forked from one process that has already imported what
every rank imports (torch, DeepSpeed, the package), with the variables
``torchrun --standalone`` gives its workers.

    python tests/runtime/forkrun.py N SCRIPT [ARGS...]

Each rank of a torchrun job imports all of that itself: about 3 s of CPU per rank on a 2-core
machine, for every job the tests start. Forked ranks share the imported modules and start training
at once, as the distributed tests of torch (``MultiProcessTestCase``) and of DeepSpeed
(``DistributedTest``) start theirs. What torchrun itself does (rendezvous, restarts, its exit
report) is tested through torchrun and the deepspeed launcher elsewhere; the tests that read its
report launch with it.

As torchrun: ``OMP_NUM_THREADS=1`` unless set; the first rank to fail ends the others (SIGTERM, then
SIGKILL after ``KILL_AFTER_S``); the exit code is 0 when every rank exited 0, else 1, with one line
per failed rank on stderr (``rank R exited with code C``). SIGTERM, SIGINT and SIGHUP to this
process reach every rank."""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

KILL_AFTER_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warm(script: str) -> None:
    """Import what the ranks import, and ask what every rank asks DeepSpeed first, here once."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (every optimizer's first construction imports it)
    import deepspeed
    import deepspeed.ops
    import ds_pipemorph.runtime.engine  # noqa: F401

    deepspeed.ops.__compatible_ops__  # the ops DeepSpeed can build: probed with the compiler, kept per process
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))


def _rank(rank: int, world: int, port: int, script: str, args: list[str]) -> None:
    """In the forked child: run ``script`` as ``__main__`` as rank ``rank``; never returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """End as the interpreter ends a script (its other threads joined, then its atexit handlers: the
    package's shutdown), without tearing down the objects it inherited: a forked process that frees them
    touches, and so copies, every page of its parent's heap (about 1 s of CPU per rank)."""
    try:
        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: forkrun.py N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    world, script, args = int(argv[0]), argv[1], argv[2:]
    _warm(script)
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, script, args)
        ranks[pid] = rank

    def forward(sig, _frame):
        for pid in ranks:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    failed: dict[int, int] = {}
    deadline = None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                forward(signal.SIGKILL, None)
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
                forward(signal.SIGTERM, None)
                deadline = time.monotonic() + KILL_AFTER_S
    for rank, code in sorted(failed.items()):
        print(f"rank {rank} exited with code {code}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
