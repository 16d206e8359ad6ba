"""What the drivers of gpu_check's steps share: an exit through Python's cleanup on SIGTERM, and the
time left of the step's budget.

GNU ``timeout`` signals only its own process group, and ``procs.run_group`` starts launchers in
sessions of their own: exiting on SIGTERM runs ``run_group``'s cleanup, which ends the launcher's
whole session. ``gpu_check.sh`` passes each step what is left of its budget as ``GPU_CHECK_STEP_S``.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable


def start_step(reserve_s: float = 10.0) -> Callable[[], float]:
    """Install the SIGTERM exit; the seconds left of this step's budget, less ``reserve_s`` to write
    its result, as a function."""
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_STEP_S", "300")) - reserve_s
    return lambda: deadline - time.monotonic()
