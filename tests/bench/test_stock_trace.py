"""The stock DeepSpeed row of `pipemorph bench` follows a delay trace the same way PipeMorph's rows do."""
import time

import pytest
import torch

from ds_pipemorph.inject.delays import DelaySchedule, DelayTraceFile
from ds_pipemorph.inject.stock import install


class _Grid:
    def get_stage_id(self):
        return 0


@pytest.mark.timeout(30)
def test_stock_injection_reads_the_trace_at_send_time_from_the_shared_epoch(monkeypatch):
    from deepspeed.runtime.pipe import p2p

    delivered = []
    monkeypatch.setattr(p2p, "send", lambda tensor, dest, async_op=False: delivered.append(time.monotonic()))
    monkeypatch.setattr(p2p, "_grid", _Grid())
    trace = DelayTraceFile.model_validate({"points": [{"t": 0.0, "links_ms": [0.0]}, {"t": 0.3, "links_ms": [120.0]},
                                                  {"t": 0.6, "links_ms": [0.0]}]})
    delays = DelaySchedule([0.0], trace)
    patch = install(delays)
    try:
        t0 = delays._t0 = time.monotonic()  # the bench sets the epoch at the first iteration, on every rank
        sent = []
        for at in (0.1, 0.4, 0.7):  # 0 ms, then 120 ms, then 0 ms again
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            sent.append(time.monotonic())
            p2p.send(torch.zeros(1), 1)
            patch["drain"]()
        lags = [d - s for d, s in zip(delivered, sent)]
        assert lags[0] < 0.06 and 0.115 <= lags[1] < 0.2 and lags[2] < 0.06, lags
    finally:
        patch["uninstall"]()
