"""A simulated or measured op timeline as a Chrome/Perfetto trace (trace-event format, ms -> µs)."""
from __future__ import annotations

import json

from ..plan.sim.timeline import Timeline


def timeline_to_chrome(tl: Timeline, name: str = "plan") -> dict:
    events: list[dict] = []
    for s in range(tl.stages):
        events.append({"ph": "M", "pid": s, "tid": 0, "name": "process_name", "args": {"name": f"stage {s}"}})
        events.append({"ph": "M", "pid": s, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
    for slot in sorted(tl.slots, key=lambda x: (x.stage, x.start)):
        events.append(
            {
                "ph": "X",
                "pid": slot.stage,
                "tid": 0,
                "name": str(slot.op),
                "cat": slot.op.kind,
                "ts": round(slot.start * 1000.0, 3),
                "dur": round((slot.end - slot.start) * 1000.0, 3),
                "args": {"stage": slot.stage, "microbatch": slot.op.mb},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": name, "iteration_ms": tl.iteration_ms, "bubble_rate": tl.bubble_rate},
    }


def chrome_json(tl: Timeline, name: str = "plan") -> str:
    return json.dumps(timeline_to_chrome(tl, name)) + "\n"
