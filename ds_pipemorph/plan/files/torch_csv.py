"""torch pipelining's schedule CSV (``_PipelineScheduleRuntime._load_csv``): write a lowered plan,
read a torch schedule's compute order.

The file has one row per rank; each cell is an ``_Action``: ``[stage]TYPE[micro-batch]`` with TYPE
``F`` forward, ``I`` backward-input, ``W`` backward-weight, ``B`` full backward (input and weight
together), ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``. torch's ``I`` is this project's ``B``. A
row written here is a lowered stream (``plan.ir.lower``): torch loads it with
``format="compute_comms"`` and runs it as it is. One stage per rank.

Pure Python: no torch (the export command must run where torch is not installed).
"""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from ...fileio import BadInput
from ..ir.lower import Stream
from ..ir.ops import Kind, Op, Schedule, format_stage, warmup_counts
from ..sim.validate import InvalidPlan, validate_schedule
from .planfile import PlanFile

_TO_TORCH = {Kind.B: "I"}  # our backward-input is torch's BACKWARD_INPUT
_FROM_TORCH = {"F": Kind.F, "I": Kind.B, "W": Kind.W}  # torch's action text -> our kind (its "B" is F's fused backward)
_CELL = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|I|B|W)(\d*)$")


def check_torch_runnable(schedule: Schedule) -> None:
    """Raise ValueError unless torch's runtime computes the right losses for ``schedule``: it
    appends each loss as the last stage's forwards run and reads the loss of micro-batch m at
    index m, so the last stage must run its forwards in micro-batch order."""
    last = [op.mb for op in schedule[-1] if op.kind is Kind.F]
    for i, m in enumerate(last):
        if m != i:
            raise ValueError(
                f"stage {len(schedule) - 1} runs F{m} as its forward #{i}: torch pipelining keeps losses in forward"
                " order, so the last stage must run its forwards in micro-batch order"
            )


def torch_csv(streams: list[Stream]) -> str:
    """The streams as torch's compute+comms CSV, one row per rank.

    Each row gets ``REDUCE_GRAD`` right after its last W, where torch's own lowering
    (``_add_reduce_grad``) puts it: there torch scales the gradients by 1/N (``scale_grads``) and
    finishes FSDP's gradient reduction."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for r, stream in enumerate(streams):
        last_w = max((i for i, op in enumerate(stream) if op.kind is Kind.W), default=None)
        row = []
        for i, op in enumerate(stream):
            row.append(f"{op.stage}{_TO_TORCH.get(op.kind, op.kind)}{op.mb}")
            if i == last_w:
                row.append(f"{r}REDUCE_GRAD")
        w.writerow(row)
    return buf.getvalue()


def read_torch_csv(text: str, where: str = "the torch CSV") -> tuple[Schedule, bool]:
    """The compute order per stage of a torch schedule CSV and whether its backward is fused.

    A full backward ``B`` becomes B m followed by W m (fused: the input gradient leaves after
    both). Communication cells are checked (stage, micro-batch) and otherwise ignored: the
    simulator places communication itself. Raises ValueError with one sentence naming the rank and
    cell to fix; the plan's validity (every op once, dependencies) is the caller's to check.
    """
    if "\x00" in text:
        raise ValueError(f"{where} is not a CSV text file")
    try:
        rows = [[c.strip() for c in row] for row in csv.reader(io.StringIO(text, newline=""))]
    except csv.Error as e:
        raise ValueError(f"{where} is not a CSV file: {e}") from None
    while rows and not any(rows[-1]):
        rows.pop()  # trailing blank lines
    if len(rows) < 2:
        raise ValueError(f"{where} has {len(rows)} rank rows; a pipeline needs at least 2 (one row per rank)")
    schedule: Schedule = []
    fused = split = False
    for r, row in enumerate(rows):
        ops: list[Op] = []
        for c, cell in enumerate(row):
            if not cell:
                continue
            m = _CELL.match(cell)
            if not m:
                raise ValueError(
                    f"{where}: rank {r}, column {c + 1}: '{cell[:40]}' is not a torch pipelining action (e.g. 0F1, 1I0)"
                )
            stage, action, mb = int(m.group(1)), m.group(2), m.group(3)
            if action in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
                continue  # FSDP and gradient-reduction actions take no pipeline time here
            if mb == "":
                raise ValueError(f"{where}: rank {r}, column {c + 1}: '{cell}' names no micro-batch (e.g. {cell}0)")
            if stage >= len(rows):
                raise ValueError(
                    f"{where}: rank {r}, column {c + 1}: '{cell}' is for stage {stage}, but the file has {len(rows)}"
                    " ranks (one stage per rank)"
                )
            if stage != r:
                raise ValueError(
                    f"{where}: rank {r}, column {c + 1}: '{cell}' is for stage {stage}; only one stage per rank"
                    " (stage r on rank r) is supported"
                )
            if action == "B":  # torch's full backward: our B and W
                fused = True
                ops += [Op(Kind.B, int(mb)), Op(Kind.W, int(mb))]
            elif action in _FROM_TORCH:
                split |= action == "I"
                ops.append(Op(_FROM_TORCH[action], int(mb)))
        schedule.append(ops)
    if fused and split:
        raise ValueError(f"{where} mixes full backwards (B) and split ones (I + W); use one of them")
    return schedule, fused


def read_torch_plan(path) -> tuple[PlanFile, Schedule]:
    """A torch schedule CSV as a plan without a profile, and its validated compute orders;
    BadInput names the file, the rank and the cell to fix."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{path} is not a CSV text file (it is not UTF-8 text)") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        schedule, fused = read_torch_csv(text, str(path))
    except ValueError as e:
        raise BadInput(str(e)) from None
    S = len(schedule)
    N = 1 + max((op.mb for row in schedule for op in row), default=-1)
    try:
        if N == 0:
            raise InvalidPlan("it lists no compute action (F, I, B, W)")
        validate_schedule(schedule, S, N)
    except InvalidPlan as e:
        raise BadInput(f"{path}: {e}") from None
    pf = PlanFile(stages=S, microbatches=N, warmup=warmup_counts(schedule),
                  schedule=[format_stage(r) for r in schedule], backward="fused" if fused else "split")
    return pf, schedule
