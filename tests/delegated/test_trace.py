"""A delay trace replays on delegated links too, on the training process's clock: the delegates look
the delay up per message, so a step in the trace shows in each message's delivery latency.

Trace: 60 ms on link 0 from t = 0, 5 ms from t = 0.8 s (t = 0 is the sender's first message). Stage 0
sends one message at a time; stage 1 measures each one's latency (same host: one monotonic clock).
The same run on the direct path (DelayInjector) is the reference. Tolerances are wide: the machine
is shared and noisy.
"""
import statistics

import bodies
import pytest
from workers import launch

HIGH_MS, LOW_MS, STEP_S, TOTAL_S = 60.0, 5.0, 0.8, 1.6


@pytest.mark.timeout(150)
def test_delegated_link_follows_a_delay_trace_step_like_the_direct_link(tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text(f"points: [{{t: 0.0, links_ms: [{HIGH_MS}]}}, {{t: {STEP_S}, links_ms: [{LOW_MS}]}}]\n")
    res = launch(2, bodies.trace_latency, ["off", "always"], str(trace), TOTAL_S)[1]
    for mode in ("off", "always"):
        before = [lat * 1000 for t, lat in res[mode] if t < STEP_S - 0.1]
        after = [lat * 1000 for t, lat in res[mode] if t > STEP_S + 0.1]
        assert len(before) >= 4 and len(after) >= 4, (mode, res[mode])
        assert statistics.median(before) >= HIGH_MS * 0.9, (mode, before)
        assert statistics.median(after) <= LOW_MS + 20.0, (mode, after)
        assert min(after) >= LOW_MS * 0.9, (mode, after)
