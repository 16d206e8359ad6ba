"""Handing a delegated transport's injected delays to its sender delegates (testing only).

A sender delegate applies its link's injected delay itself, per message, when it sends it. The training
process keeps the delays (a ``runtime.hooks.DelaySource``: static per link, or a trace replayed from
its first message) and shares two things with its delegates in shared memory, created at the first
spawn: the current static delays and the trace's origin on ``time.monotonic``. They are published again
before each message, so a trace replays on the same clock on both paths and a static delay changed at
runtime reaches delegates that are already running.
"""
from __future__ import annotations

import math


class DelayPublishing:
    """Part of ``DelegatedTransport``: ``self.delays`` (a ``DelaySchedule`` or None), ``self._ctx`` (the
    fork server context) and ``self._shared_delays`` (None until the first sender delegate starts)."""

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
