"""Writes docs/config.md, the reference of the ds_config ``"pipemorph"`` section, from its pydantic models.

    python -m ds_pipemorph.runtime.config_doc            # rewrite docs/config.md (atomically)
    python -m ds_pipemorph.runtime.config_doc --check    # exit 1 if docs/config.md differs from the models

Names, types, limits and defaults come from the models in ``config.py`` and, for a plug-in's section
(``inject``), from the model of the plug-in registered for it (``runtime.hooks``); the meaning of each
key is ``DESCRIPTIONS`` below or the plug-in's ``descriptions``, keyed by dotted path (``*`` stands for
any key of a mapping, as in ``inject.links.*.delay_ms``). ``missing_and_unknown`` names the keys of the models without a
description and the descriptions naming no key; tests/docs/test_config_doc.py holds both empty.
"""
from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Literal, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ..fileio import write_atomic
from . import config, hooks
from .config import PipeMorphConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"

DESCRIPTIONS: dict[str, str] = {
    "schedule": "`1f1b`: DeepSpeed's 1F1B order, each backward run as B immediately followed by its W; `zb`: "
                "zero-bubble order with ZB-H1 warm-up (S − s) or `memory.max_inflight`; `adaptive`: Alg. 1 warm-up "
                "from the memory caps, re-planned from measurements (see `adapt`); `plan`: the plan in `plan_file`, "
                "never re-planned",
    "plan_file": "a plan from `pipemorph plan`; required with `schedule: plan` and refused otherwise; its stages "
                 "and micro-batches must match the job",
    "dispatch": "`ordered`: each stage runs its plan's order as written; `ready`: the order is a hint (RRFP) and "
                "each stage runs the first op in it that is ready (its activation or gradient arrived; F only "
                "while it holds fewer activations than the plan's peak), every receive of the iteration posted "
                "at once before the first op that needs one (`docs/ready_dispatch.md`)",
    "memory": "how much activation memory a stage may hold (`docs/memory.md`)",
    "memory.max_inflight": "cap on in-flight activations (F done, B not done): one value for every stage or one "
                           "per stage; `null`: the micro-batch count. Given without `budget`, it is the grant "
                           "and the default budget is off",
    "memory.budget": "activation memory per stage as a multiple of stock DeepSpeed 1F1B's on it (S − s "
                     "micro-batches' activations); counts what F keeps for B and what B keeps for W, in every "
                     "schedule, re-plan and dispatch; at least 1.0; `null`: no limit but `max_inflight`. A plan file "
                     "(`schedule: plan`) runs as written unless `budget` is set",
    "memory.budget_mb": "the same activation memory granted in MiB (what F keeps for B plus what B keeps for W): "
                        "one value for every stage or one per stage (as many as stages). The first iteration "
                        "runs within stock 1F1B's (`budget` 1.0) and measures each stage's activations per "
                        "micro-batch; from the second on, on every rank alike, every plan, re-plan and dispatch "
                        "keeps within the grant. It may be tighter than stock's but not below one micro-batch's "
                        "activations on a stage, nor below stock's `S - s` micro-batches under `schedule: 1f1b` "
                        "(refused after the first iteration, naming the least that runs on every stage); not together with `budget`, a plan file (`schedule: plan`) or moving layers "
                        "or ranks (`rebalance`, `orchestrate`)",
    "adapt": "PipeMorph's control loop, with `schedule: adaptive`",
    "adapt.enabled": "measure F, B, W and every link each iteration and re-plan (Alg. 2) when the detector sees a "
                     "link slower than the plan absorbs; all ranks adopt the same plan at the next iteration",
    "adapt.every_iterations": "run the detector every this many iterations, at iteration boundaries",
    "adapt.replan": "`background`: a re-plan first adopts Alg. 2's closed-form warm-up (or keeps the plan in force "
                    "where that replays faster and still fits the memory), rank 0 runs the search in "
                    "a low-priority worker process beside training, and every rank switches to the searched plan "
                    "at the first boundary after it lands; `inline`: the search runs at the boundary while every "
                    "rank waits",
    "adapt.search_evals": "the search's effort per re-plan, in replays, not time: the same input gives the same "
                          "plan on any machine",
    "delegation": "delegate processes that carry a link's messages through host staging rings (PipeMorph §5)",
    "delegation.mode": "`off`: every link direct (DeepSpeed p2p in the training process); `always`: every link "
                       "through delegates; `auto`: the control loop moves slow links to "
                       "delegates and back where a direct send holds the training process (NCCL, the injected "
                       "delays); with gloo, whose sends do not, slow links stay direct and are planned as one FIFO",
    "delegation.queues": "delegate FIFOs per link direction when a link is first delegated",
    "delegation.max_queues": "the control loop gives a delegated link more FIFOs, up to this many, when its delay "
                             "needs them to keep pace with the stages (§5.2, checked by replay); their delegates "
                             "start with the link; `null`: max(`queues`, 4); equal to `queues`: never grows",
    "delegation.interfaces": "network interfaces for the delegates' Gloo connections, in turn: a delegate pair that "
                             "meets again after its connection broke uses the next one (§5.3); each rank checks at "
                             "start-up that its host has them; `null`: Gloo's default",
    "delegation.slot_mb": "staging slot size in MiB; a larger message travels in pieces, each costing the "
                          "delegates round trips; on CPU only the pages messages reach are allocated, on a GPU the "
                          "whole ring is pinned",
    "delegation.slots": "slots per staging ring (one ring per delegate queue and end): messages a queue holds ahead "
                        "(pieces of one where `send_window` is in force, on CPU)",
    "rebalance": "compute stragglers: layers move away from a stage that runs slower than its layers should "
                 "(`docs/rebalance.md`)",
    "rebalance.enabled": "compare each stage's F + B + W with what its layers should cost every iteration; when a "
                         "stage stays slowed, move layers to the best partition one migration step reaches, with "
                         "their parameters, gradients and Adam state, at an iteration boundary",
    "rebalance.noise": "a stage counts as slowed (or recovered) when its F + B + W sit this fraction away, on the "
                       "same side, from what its layers should cost ...",
    "rebalance.patience": "... for this many iterations in a row",
    "rebalance.min_gain": "move layers only if the predicted iteration time improves by at least this fraction",
    "rebalance.warmup_iterations": "without `layer_profile`: iterations measured at the start to learn what each "
                                   "layer costs, taking layers of one signature to cost the same on every stage; a "
                                   "stage slow from the start shows only where some stage holds one of its layer "
                                   "classes alone (`docs/rebalance.md`)",
    "rebalance.layer_profile": "a layer profile (`pipemorph profile-stages --per-layer`, `docs/partition.md`) used "
                               "instead of the warm-up measurement",
    "rebalance.timeout_s": "seconds a migration's transfer may take; past it every rank keeps its layers and the "
                           "next detection tries again",
    "compare": "A/B inside the job: the job's own schedule and dispatch (B) alternate with these (A) at iteration "
               "boundaries, A B A' B, and rank 0 logs B/A per pair with its 95 % interval "
               "(README, `runtime/ab_compare.py`)",
    "compare.schedule": "A's schedule; `null`: no comparison",
    "compare.dispatch": "A's dispatch",
    "compare.backward": "A's backward (`split` or `fused`, as `backward`); `null`: the job's own. "
                        "`{\"schedule\": \"1f1b\", \"backward\": \"fused\"}` is stock's schedule and backward",
    "compare.warmup": "iterations at the start that alternate but are not measured",
    "compare.iterations": "measured iterations, then the result is logged and the job runs B only; `null`: until "
                          "the engine is destroyed (the end of training)",
    "orchestrate": "a slow link inside the data-parallel rings (PipeMorph §6): ranks re-mapped while training "
                   "runs (`docs/placement.md`)",
    "orchestrate.matrix": "the link matrix of `pipemorph profile-links --all-pairs`; when the all-reduce is "
                          "measured slower than the best placement's rings would take, every rank takes the "
                          "coordinate `pipemorph place` gives it and `ds_pipemorph.initialize`'s handle follows "
                          "the new engine; `null`: off",
    "orchestrate.grad_mb": "gradient MB per stage the all-reduce moves; `null`: each stage's parameter bytes",
    "orchestrate.chunk_mb": "MB per all-reduce message, as `pipemorph place --chunk-mb`; `null`: one message per "
                            "ring step",
    "orchestrate.noise": "a stage's all-reduce this fraction above what the best placement's ring would take ...",
    "orchestrate.patience": "... in this many iterations in a row is a data-parallel straggler",
    "orchestrate.min_gain": "re-map only if the predicted iteration time improves by at least this fraction",
    "max_exchange_gap": "the control loops (`adapt`, `rebalance`, `orchestrate`) exchange their measurements (one "
                        "collective) every iteration while anything changes and 2, 4, … up to this many iterations "
                        "apart while nothing does: a slow link or stage is acted on at most this many − 1 "
                        "iterations later than with an exchange every iteration; 1: every iteration",
    "recv_window": "receives of each kind (activations, gradients) a stage keeps posted ahead of the ops that "
                   "consume them under ordered dispatch (NCCL's lowering issues each receive where its rules need "
                   "it); each holds its buffer, so the window bounds that memory; "
                   "at least the micro-batch count posts every receive of an iteration up front, the fewest "
                   "calls between ops; `null`: 1; a plan file names its own (refused with `schedule: plan`)",
    "backward": "`split`: every backward runs as B (the input gradient, sent at once) and W (the weight gradients, "
                "when the plan says); `fused`: a B directly followed by its W in the plan (every backward of `1f1b`, "
                "and of `zb` where it does not defer W) runs as one backward pass, as stock DeepSpeed's, cheaper "
                "than B and W apart, its input gradient sent after it; refused with `adaptive`, which plans for a "
                "split backward. The first stage, which sends no input gradient, runs such a pair as one pass "
                "under either, with `dispatch: ordered` (not while `adaptive` re-plans: its control loop measures "
                "B and W apart). A plan file names its own (refused with `schedule: plan`)",
    "send_window": "messages of one kind a stage keeps sent but not known received, per peer, where a send "
                   "completes only when waited for (gloo; NCCL's go as they complete): the next send, once "
                   "issued, waits for the oldest, so the window bounds the memory of sends in flight; applied "
                   "to a kind only where the peer receives it in the order sent and a dry run of the plan with "
                   "the window finds no deadlock (`docs/memory.md`); while it is in force, a delegated link's "
                   "messages are cut to fit one queue's staging ring on CPU (one message per queue and end); "
                   "`null`: 2, and none where no memory budget "
                   "is in force (`memory.budget: null`, a `max_inflight` grant, a plan file)",
    "nvtx": "NVTX ranges in domain `pipemorph`: `ITER<k>` around each `train_batch` and one nested range per op "
            "(`F3`, `SEND_F3`, `RECV_B3`, …; under ready dispatch each receive is a range on its receive thread); "
            "nothing is emitted while no profiler is attached",
    "timeline": "path: rank 0 writes a Chrome/Perfetto trace of every rank's ops (last 20 iterations), readable "
                "by `pipemorph trace inspect`",
    "profile_out": "path: with the control loop, rank 0 writes the measured profile (input of `pipemorph plan`) "
                   "at every re-plan and at the end of training",
    "timeout_s": "seconds any wait on another rank may take before failing with a message naming the rank, link "
                 "and op",
}


def _args(t) -> tuple:
    return typing.get_args(t)


def _is_optional(t) -> bool:
    return typing.get_origin(t) in (Union, types.UnionType) and type(None) in _args(t)


def _strip_none(t):
    rest = [a for a in _args(t) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Union[tuple(rest)]


def _model_in(t):
    """The model class a field holds (directly, optionally, or as the values of a mapping), else None."""
    if _is_optional(t):
        t = _strip_none(t)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t, ""
    if typing.get_origin(t) is dict and isinstance(_args(t)[1], type) and issubclass(_args(t)[1], BaseModel):
        return _args(t)[1], "*."
    return None, ""


def descriptions() -> dict[str, str]:
    """``DESCRIPTIONS`` and those of every registered plug-in."""
    out = dict(DESCRIPTIONS)
    for key in hooks.PLUGIN_SECTIONS:
        if hooks.plugin(key) is not None:
            out.update(hooks.plugin(key).descriptions)
    return out


def walk(model: type[BaseModel] = PipeMorphConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, pydantic FieldInfo) of every key of ``model``, depth first in declaration order; a
    plug-in's section is a section of its plug-in's model."""
    for name, info in model.model_fields.items():
        path = prefix + name
        plugin = hooks.plugin(name) if model is PipeMorphConfig and name in hooks.PLUGIN_SECTIONS else None
        if plugin is not None:
            info = FieldInfo(annotation=plugin.model, default_factory=plugin.model)
        yield path, info
        inner, glue = _model_in(info.annotation)
        if inner is not None:
            yield from walk(inner, f"{path}.{glue}")


def missing_and_unknown() -> tuple[list[str], list[str]]:
    """Keys of the models without a description, and descriptions that name no key of the models."""
    paths, known = [p for p, _ in walk()], descriptions()
    return [p for p in paths if p not in known], sorted(set(known) - set(paths))


def type_text(t) -> str:
    if _is_optional(t):
        return f"{type_text(_strip_none(t))} or null"
    origin = typing.get_origin(t)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in _args(t))
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in _args(t))
    if origin is list:
        return f"list of {type_text(_args(t)[0])}"
    if origin is dict:
        return f"mapping of {type_text(_args(t)[0])} to {type_text(_args(t)[1])}"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return "section"
    if isinstance(t, type) and issubclass(t, Enum):  # a TextEnum (``Dispatch``): the texts it reads
        return " or ".join(json.dumps(m.value) for m in t)
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(t, getattr(t, "__name__", str(t)))


def limits_text(info) -> str:
    signs = {Gt: ("> ", "gt"), Ge: ("≥ ", "ge"), Lt: ("< ", "lt"), Le: ("≤ ", "le")}
    parts = [sign + f"{getattr(m, attr):g}" for m in info.metadata for kind, (sign, attr) in signs.items()
             if isinstance(m, kind)]
    return ", ".join(parts)


def default_text(info) -> str:
    if info.default is not PydanticUndefined:
        value = info.default
    elif info.default_factory is not None:
        value = info.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


HEADER = """\
# The `"pipemorph"` section of a ds_config

<!-- Generated by `python -m ds_pipemorph.runtime.config_doc` from ds_pipemorph/runtime/config.py; do not edit. -->

`ds_pipemorph.initialize` reads this section of the ds_config (DeepSpeed ignores it). Every key is
optional; unknown keys and wrong types are refused at start-up with one sentence naming the key,
and settings without effect under the chosen schedule are named in a warning.

Types are checked, not converted: a value must have the type its key has in the tables below. `"7"`
is not an integer, `true` is neither an integer nor a number, `"yes"` is not a boolean (write `true`
or `false`) and `"30"` is not a number (`ds_config pipemorph: memory.max_inflight: expected an
integer, got the string '7'`). The one exception is a whole number where a number is expected, as
JSON writes it: `"timeout_s": 30` is 30.0.

A minimal section, granting 1.5x stock 1F1B's activation memory per stage (without `memory`, each
stage holds no more than stock does):

```json
"pipemorph": {"schedule": "adaptive", "memory": {"budget": 1.5}}
```

`memory.max_inflight` given without `budget` is a grant in micro-batches: it turns the default
budget off, and with it the send window (`docs/memory.md`). `memory.budget_mb` grants the same memory
as `budget` in MiB per stage (`{"budget_mb": 2048}` or one value per stage), in force from the second
iteration on.

`*` in a key stands for any key of a mapping (`inject.links.*.delay_ms` is `{"links": {"2":
{"delay_ms": 30}}}` inside `inject`). Keys marked "testing only" make stragglers on purpose.
"""


def paths_text() -> str:
    """The sentence on relative paths, naming the keys ``config.path_keys()`` resolves (none: no sentence)."""
    keys = [".".join(route) for route in config.path_keys()]
    if not keys:
        return ""
    return (f"Relative paths in {', '.join(f'`{k}`' for k in keys)} are read against the directory of the "
            f"config file (the working directory when the config is not a file); see [`paths.md`](paths.md).\n")


def render() -> str:
    """The whole of docs/config.md for the models as they are."""
    missing, unknown = missing_and_unknown()
    if missing or unknown:
        raise ValueError(f"config_doc.DESCRIPTIONS: no description for {missing or 'nothing'}; "
                         f"descriptions naming no key: {unknown or 'none'}")
    known = descriptions()
    groups: dict[str, list[str]] = {"": []}  # top-level section -> its rows ("": keys at the top level)
    for path, info in walk():
        top = path.split(".")[0]
        if path == top and default_text(info) == "(section)":
            groups[top] = []
            continue
        kind = type_text(info.annotation)
        limits = limits_text(info)
        kind = f"{kind} ({limits})" if limits else kind
        default = default_text(info)
        default = default if default == "required" else f"`{_cell(default)}`"
        row = f"| `{path}` | {_cell(kind)} | {default} | {_cell(known[path])} |"
        groups[top if top in groups and top else ""].append(row)
    out = [HEADER, paths_text()] if paths_text() else [HEADER]
    for top, rows in groups.items():
        about = known[top] if top else "keys outside the sections below"
        out += [f"## {f'`{top}`' if top else 'Top level'}\n", f"{about[0].upper()}{about[1:]}.\n",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_pipemorph.runtime.config_doc",
                                 description="Write docs/config.md from the pipemorph config models.")
    ap.add_argument("--out", type=Path, default=DOC, help=f"file to write (default: {DOC})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the models; run without --check'}")
        return 0 if same else 1
    write_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
