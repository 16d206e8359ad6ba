"""The engine's ``"timeline"`` option: a Chrome/Perfetto trace of every rank's ops, without Nsight.

At the end of each iteration every rank hands its op records (the same ones its NVTX ranges cover)
to rank 0, which keeps the last ``KEEP`` iterations and rewrites the file atomically in the format
of ``ds_pipemorph.trace.measured_chrome`` (one process per rank; compute, send and receive tracks;
an arrow from each send to its receive), so ``pipemorph trace inspect|compare`` read it. Times come
from each rank's monotonic clock, which all processes of one host share.
"""
from __future__ import annotations

import torch.distributed as dist

from ..fileio import write_atomic
from ..trace.measured import IterMark, MeasuredOp, MeasuredTrace, RankTrace, parse_range_name
from ..trace.measured_chrome import chrome_json

KEEP = 20


class TimelineWriter:
    def __init__(self, path: str, stage_id: int):
        self.path = path
        self.stage_id = stage_id
        self.iteration = -1
        self._ranks: dict[int, RankTrace] = {}

    def after_iteration(self, records) -> None:
        """Called on every rank at the same iteration boundary."""
        self.iteration += 1
        mine = [(r.op, r.start_ns, r.end_ns) for r in records]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dist.get_rank(), self.stage_id, mine))
        if dist.get_rank() != 0:
            return
        k = self.iteration
        for rank, stage, recs in everyone:
            rt = self._ranks.setdefault(rank, RankTrace(rank, stage, None, []))
            ops = []
            for name, start, end in recs:
                parsed = parse_range_name(name)
                if parsed is not None and parsed.what in ("compute", "send", "recv"):
                    ops.append(MeasuredOp(parsed.what, parsed.op, start, end, k))
            if recs:
                rt.marks[k] = IterMark(min(r[1] for r in recs), max(r[2] for r in recs))
            rt.ops = [o for o in rt.ops if o.iteration > k - KEEP] + ops
            rt.marks = {i: m for i, m in rt.marks.items() if i > k - KEEP}
            rt.__dict__.pop("by_iteration", None)  # a cached view of the old ops
        trace = MeasuredTrace("pipemorph engine timeline", [self._ranks[r] for r in sorted(self._ranks)])
        write_atomic(self.path, chrome_json(trace))
