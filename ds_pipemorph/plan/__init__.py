"""The planner, pure Python (no torch, no deepspeed), in six subpackages:

- ``ir``: the schedule as data (ops, link models, stage costs, lowering, the readiness rule);
- ``sim``: replaying a schedule (simulator, compiled core, timeline, readiness replay, validity);
- ``files``: plan files, torch pipelining's CSV, link matrices;
- ``sched``: making schedules (list scheduler, warm-ups, baselines, search, bounds, tolerances);
- ``partition``: cutting layers into stages;
- ``place``: placing ranks on the pipeline x data-parallel grid.

The names in ``__all__`` are what users and the CLI need, importable from here
(``from ds_pipemorph.plan import Op, Costs, replay``). Each is imported from its module on first
use, so importing ``ds_pipemorph.plan`` or one of its modules loads no other planner module than
those it needs (the package ``ds_pipemorph`` itself registers the injection plug-in first, which
loads pydantic: about 0.2 s); the compiled core is built only when a replay first asks for it.
"""
from __future__ import annotations

import importlib

# name -> the module (under ds_pipemorph.plan) that defines it
_HOME = {
    "Op": "ir.ops", "Kind": "ir.ops", "Schedule": "ir.ops", "parse_op": "ir.ops",
    "Costs": "ir.profile", "Profile": "ir.profile",
    "LinkModel": "ir.links", "Latency": "ir.links", "Direct": "ir.links", "Delegated": "ir.links",
    "Route": "ir.links", "LATENCY": "ir.links", "DIRECT": "ir.links",
    "Lowering": "ir.lower", "LoweringPolicy": "ir.lower", "lower": "ir.lower", "dry_run": "ir.lower",
    "NcclLowering": "ir.nccl_lowering", "nccl_dry_run": "ir.nccl",
    "ReadyRule": "ir.ready_rule",
    "replay": "sim.simulate", "makespan": "sim.simulate",
    "Timeline": "sim.timeline", "StuckSchedule": "sim.timeline",
    "replay_ready": "sim.ready", "replay_varying": "sim.ready",
    "InvalidPlan": "sim.validate", "validate_schedule": "sim.validate",
    "PlanFile": "files.planfile", "LinkMatrix": "files.linkmatrix",
    "list_schedule": "sched.listsched", "Policy": "sim.listsched_py",
    "search": "sched.search", "SearchResult": "sched.search",
    "baseline": "sched.baselines", "initial_warmup": "sched.warmup", "adapted_warmup": "sched.warmup",
    "lower_bound_ms": "sched.bounds", "link_tolerances": "sched.tolerance",
    "LayerProfile": "partition.layer_profile", "PartsFile": "partition.parts",
    "Placement": "place.placement",
}

__all__ = list(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
