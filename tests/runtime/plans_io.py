"""Writing plans as plan files (the docs/design.md contract) for the engine to read."""
from __future__ import annotations

from pathlib import Path

import yaml

from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.ir.ops import Op, format_stage, warmup_counts


def write_plan(path: Path, plan: list[list[Op]], microbatches: int, fused: bool = False) -> str:
    """``fused``: a B directly followed by its W runs as one backward (the plan file's ``fused``)."""
    pf = PlanFile(stages=len(plan), microbatches=microbatches, warmup=warmup_counts(plan),
                  schedule=[format_stage(r) for r in plan], backward="fused" if fused else "split")
    path.write_text(yaml.safe_dump(pf.model_dump(exclude_none=True), sort_keys=False))
    return str(path)
