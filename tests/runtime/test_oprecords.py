"""Per-op records and NVTX ranges around every instruction (no ranks).

The NVTX side is checked on what a tool receives: a subprocess runs the recorder with an NVTX
injection library loaded (``tests/nvtx/nvtx_recorder.c``), which records every range opened and closed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_pipemorph.runtime.oprecords import OpRecorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvtx"))
from nvtx_capture import build_injection, injection_env, read_all, unavailable_reason  # noqa: E402

# Two batches of a stage-1 recorder (global rank 3), and a recorder with nvtx off in the same process.
SCRIPT = """
import json, sys, time
from ds_pipemorph.runtime.oprecords import OpRecorder
on, off = OpRecorder(True, stage=1, rank=3), OpRecorder(False, stage=2, rank=9)
records = []
for _ in range(2):
    with on.iteration():
        for name in ("RECV_F0", "F0", "SEND_F0", "OptimizerStep"):
            on.run(name, time.sleep, 0.001)
    records += [list(r) for r in on.records]
    on.reset()
    with off.iteration():
        off.run("F5", time.sleep, 0.001)
json.dump({"records": records, "active": [on.nvtx_active, off.nvtx_active]}, sys.stdout)
"""


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


@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
@pytest.mark.timeout(120)
def test_a_tool_receives_one_iter_range_per_batch_and_one_nested_range_per_op(tmp_path):
    env = {**os.environ, **injection_env(build_injection(tmp_path), tmp_path / "nvtx")}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["active"] == [True, False]  # nvtx: false emits nothing even with a tool attached
    (proc,) = read_all(tmp_path / "nvtx")
    ranges = proc.in_domain("pipemorph")
    assert len(ranges) == len(proc.ranges) == 2 * (1 + 4)  # nothing outside the domain, nothing from `off`
    assert [name for _, _, _, _, name in proc.categories] == ["stage1"]  # named once, by nvtxDomainNameCategoryA
    assert all(r.kind == "push_pop" and r.end is not None and r.category == "stage1" for r in ranges)
    iters = [r for r in ranges if r.depth == 0]
    assert [(r.message, r.payload_type, r.payload) for r in iters] == [("ITER0", 2, 3), ("ITER1", 2, 3)]
    ops = [r for r in ranges if r.depth == 1]
    assert [(r.message, r.payload) for r in ops] == [("RECV_F0", 0), ("F0", 0), ("SEND_F0", 0), ("OptimizerStep", None)] * 2
    for r, (name, t0, t1) in zip(ops, out["records"]):
        assert r.message == name and t0 <= r.start <= r.end <= t1  # the range sits inside the op's record
    for k, it in enumerate(iters):
        assert [r.message for r in ops if it.start <= r.start and r.end <= it.end] == ["RECV_F0", "F0", "SEND_F0", "OptimizerStep"]


def test_without_a_tool_attached_the_recorder_skips_nvtx():
    if os.environ.get("NVTX_INJECTION64_PATH"):
        pytest.skip("an NVTX tool is attached to this process")
    rec = OpRecorder(True)
    assert not rec.nvtx_active
    with rec.iteration():
        rec.run("F0", lambda: None)
    assert [r.op for r in rec.records] == ["F0"]
