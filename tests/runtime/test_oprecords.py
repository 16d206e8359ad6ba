"""Per-op records and NVTX ranges around every instruction (no ranks)."""
from __future__ import annotations

import time

import pytest

from ds_pipemorph.runtime.oprecords import OpRecorder


@pytest.mark.parametrize("nvtx_enabled", [True, False])
def test_every_op_leaves_a_record_in_order_on_the_monotonic_clock(nvtx_enabled):
    rec = OpRecorder(nvtx_enabled)
    before = time.monotonic_ns()
    for name in ("RECV_F3", "F3", "SEND_F3"):
        rec.run(name, lambda: time.sleep(0.001))
    assert [r.op for r in rec.records] == ["RECV_F3", "F3", "SEND_F3"]
    assert before <= rec.records[0].start_ns
    for a, b in zip(rec.records, rec.records[1:]):
        assert a.start_ns + 1_000_000 <= a.end_ns <= b.start_ns
    rec.reset()
    assert rec.records == []


def test_a_failing_op_propagates_its_error():
    rec = OpRecorder(True)
    with pytest.raises(ZeroDivisionError):
        rec.run("B1", lambda: 1 / 0)


def test_event_factory_times_only_compute_ops_on_the_device():
    # What a GPU run does with torch.cuda.Event(enable_timing=True), with a stand-in event whose
    # "device time" is the host time between record() calls (CUDA itself is not available here).
    class FakeEvent:
        synced = 0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            FakeEvent.synced += 1

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    rec = OpRecorder(False, FakeEvent)
    for name in ("F0", "SEND_F0", "B0", "W0"):
        rec.run(name, time.sleep, 0.002)
    ms = rec.device_ms()
    assert set(ms) == {"F0", "B0", "W0"} and all(v >= 1.5 for v in ms.values())
    assert FakeEvent.synced == 1  # one wait, on the last event
    rec.reset()
    assert rec.device_ms() == {} and OpRecorder(False).device_ms() is None
