"""CUDA-event op times against the host (wall) times of the same ops, as the engine's recorder takes them.

    python scripts/gpu_check/op_timing.py KEYS.json

``OpRecorder`` with the engine's event factory (``torch.cuda.Event(enable_timing=True)``) runs F0, SEND_F0,
B0 and W0 of one batch, three batches after a warm-up; F/B/W each launch 20 matmuls of 2048 x 2048 on
cuda:0, SEND_F0 sleeps 1 ms on the host. Checked per batch: exactly F0, B0 and W0 get a device time,
each > 0; each is longer than the op's host time (the host returns once the kernels are launched, so
the host clock, like an NVTX range, measures launches); their sum fits in the batch's wall time up to
the final synchronize. Writes KEYS.json; exit 1 on a failure.
"""
from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # a timeout's SIGTERM exits through Python's cleanup

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds_pipemorph.fileio import write_atomic  # noqa: E402
from ds_pipemorph.runtime.oprecords import OpRecorder  # noqa: E402

SIZE, MATMULS, BATCHES = 2048, 20, 3


def main() -> int:
    keys_path = Path(sys.argv[1])
    torch.cuda.set_device(0)
    a = torch.randn(SIZE, SIZE, device="cuda")

    def kernels():
        for _ in range(MATMULS):
            torch.mm(a, a)

    kernels()  # warm-up: cuBLAS handle, first launches
    torch.cuda.synchronize()
    rec = OpRecorder(False, lambda: torch.cuda.Event(enable_timing=True))
    failures, batches = [], []
    for k in range(BATCHES):
        rec.reset()
        t0 = time.perf_counter()
        for name in ("F0", "SEND_F0", "B0", "W0"):
            if name == "SEND_F0":
                rec.run(name, time.sleep, 0.001)
            else:
                rec.run(name, kernels)
        device = rec.device_ms()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        host = {r.op: (r.end_ns - r.start_ns) / 1e6 for r in rec.records}
        batches.append({"wall_ms": wall_ms, "host_ms": host, "device_ms": device})
        if set(device) != {"F0", "B0", "W0"}:
            failures.append(f"batch {k}: device times for {sorted(device)}, expected F0, B0, W0")
            continue
        for op, ms in device.items():
            if not ms > 0:
                failures.append(f"batch {k}: {op} device time {ms} ms is not > 0")
            elif not host[op] < ms:
                failures.append(f"batch {k}: {op} host time {host[op]:.3f} ms >= device time {ms:.3f} ms "
                                "(the host should only launch)")
        if sum(device.values()) > wall_ms * 1.02 + 0.5:
            failures.append(f"batch {k}: device times sum to {sum(device.values()):.2f} ms > the batch's "
                            f"wall time {wall_ms:.2f} ms")
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    good = [b for b in batches if set(b["device_ms"]) == {"F0", "B0", "W0"}]
    keys = {"gpu": torch.cuda.get_device_name(0), "batches": len(batches)}
    if good:
        keys.update({
            "device_ms_per_op": med([b["device_ms"][op] for b in good for op in ("F0", "B0", "W0")]),
            "host_ms_per_op": med([b["host_ms"][op] for b in good for op in ("F0", "B0", "W0")]),
            "batch_wall_ms": med([b["wall_ms"] for b in good]),
            "batch_device_ms": med([sum(b["device_ms"].values()) for b in good])})
    result = {"ok": not failures, "failures": failures, "key_numbers": keys, "batches": batches}
    write_atomic(keys_path, json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
