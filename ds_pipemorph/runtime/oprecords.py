"""Per-op NVTX ranges (domain "pipemorph") and start/end times on the monotonic clock.

``OpRecorder.run(name, fn, *args)`` wraps one instruction: an NVTX range named like the op (``F3``,
``SEND_B3``) when enabled (the ``nvtx`` package: < 1 µs with no profiler attached; never
``torch.cuda.nvtx``, which raises on CPU builds), and an ``OpRecord`` appended to ``records``.
The profiler and the Chrome timeline of later issues read these records.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

DOMAIN = "pipemorph"


class OpRecord(NamedTuple):
    op: str  # "F3", "B3", "W3", "SEND_F3", "RECV_B3", "OptimizerStep", ...
    start_ns: int  # time.monotonic_ns(): one clock for all processes of a machine
    end_ns: int


class OpRecorder:
    def __init__(self, nvtx_enabled: bool):
        self.records: list[OpRecord] = []
        self._nvtx = None
        if nvtx_enabled:
            import nvtx

            self._nvtx = nvtx

    def reset(self) -> None:
        self.records = []

    def run(self, name: str, fn: Callable[..., object], *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` inside an NVTX range ``name``, recorded as one OpRecord."""
        t0 = time.monotonic_ns()
        if self._nvtx is None:
            fn(*args, **kwargs)
        else:
            with self._nvtx.annotate(message=name, domain=DOMAIN):
                fn(*args, **kwargs)
        self.records.append(OpRecord(name, t0, time.monotonic_ns()))
