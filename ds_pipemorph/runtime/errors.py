"""Errors belong to ``ds_pipemorph.initialize``: a plain training script gets one sentence and a non-zero exit.

``initialize`` installs ``excepthook`` (once per process, in front of the one in place). An error of
ours that no one catches ends the process without a traceback:

- a setting refused at start-up (``PipeMorphConfigError``, ``UnsupportedDeepSpeedError``): every rank
  raises the same, rank 0 prints ``error: <sentence>`` and exits 2 at once; the other ranks exit 2
  ``CONFIG_GRACE_S`` later, when the launcher has not stopped them by then, saying it too (an error
  only they met);
- a failure detected while training (``TransportError``: a timeout, a rank that died, a link that
  cannot be failed over; ``PipeMorphConfigError`` raised later, e.g. by a re-plan): the first rank to
  fail prints ``error: <sentence>``, its lifeline tells the job (``runtime.lifeline``: the others stop
  within a second or two, silently), it exits 1;
- a Ctrl-C before the lifeline catches signals (during start-up): ``rank R: stopped by SIGINT``
  on rank 0, exit 130.

Anything else keeps its traceback (it is a bug, or the script's own); the lifeline still tells the
job, so the other ranks stop instead of waiting for their timeouts. Code that catches these errors
itself (a test, a script's own ``except``) is unaffected: the hook sees only what nobody caught.
"""
from __future__ import annotations

import atexit
import os
import sys

from ..fileio import first_line

CONFIG_EXIT, FAILURE_EXIT = 2, 1
CONFIG_GRACE_S = 10.0  # ranks but 0 wait this long before they say a start-up error themselves
_installed = False


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0"))


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(tp, value, tb):
        _defer_to_lifeline()
        try:
            handled = _handle(value)
        except Exception:  # noqa: BLE001  (never hide the error behind one of ours)
            handled = False
        if not handled:
            previous(tp, value, tb)
            from .lifeline import current

            life = current()
            if life is not None:
                life.fail(f"rank {_rank()} failed: {type(value).__name__}: {first_line(value)}")

    sys.excepthook = hook


def _defer_to_lifeline() -> None:
    """An error that a neighbour's death caused (a collective or a link failing because the peer's
    process is gone) is the lifeline's to report: it names the rank that died and ends this process."""
    from .lifeline import current

    life = current()
    if life is not None and life.settle(1.0):
        import time

        time.sleep(60)  # the lifeline's thread exits the process


def _handle(e: BaseException) -> bool:
    """End the process for one of our errors (True never returns); False: not ours."""
    from .config import PipeMorphConfigError
    from .ds_compat import UnsupportedDeepSpeedError
    from .lifeline import current
    from .transport.protocol import TransportError

    life = current()
    if isinstance(e, KeyboardInterrupt):
        if _rank() == 0:
            print(f"rank {_rank()}: stopped by SIGINT", file=sys.stderr, flush=True)
        _end(130)
    if isinstance(e, (PipeMorphConfigError, UnsupportedDeepSpeedError)) and life is None:
        # Every rank raises the same at start-up: rank 0 says it. The others wait for a moment first:
        # a launcher stops the whole job when one rank exits, rank 0 maybe before it printed. One that
        # is still there later (an error of its own, or no launcher stopping it) says it too.
        if _rank() != 0:
            import time

            time.sleep(CONFIG_GRACE_S)
        print(f"error: {e}", file=sys.stderr, flush=True)
        from .shutdown import exit_process

        exit_process(CONFIG_EXIT)
    if isinstance(e, (PipeMorphConfigError, UnsupportedDeepSpeedError, TransportError)):
        sentence = first_line(e)
        first = life.claim_end(sentence) if life is not None else True
        if first:
            print(f"error: {sentence}", file=sys.stderr, flush=True)
        _end(FAILURE_EXIT)
    return False


def _end(code: int) -> None:
    """Exit now: the delegates stopped and their rings unlinked without the transports' locks (a
    background thread may hold one), the exit handlers run (the lifeline tells the job), no
    interpreter teardown (``runtime.shutdown``)."""
    from .shutdown import flush_all, skip_release
    from .transport.delegated.transport import kill_all

    kill_all()
    skip_release()
    atexit._run_exitfuncs()
    flush_all()
    os._exit(code)
