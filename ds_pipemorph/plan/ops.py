"""Op texts of the schedule IR: ``F3``, ``B3``, ``W3`` (kind + micro-batch).

F is a forward, B a backward-input (gradient w.r.t. the stage input), W a backward-weight.
Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import re
from typing import NamedTuple

KINDS = ("F", "B", "W")
_OP_RE = re.compile(r"^([FBW])(\d+)$")


class Op(NamedTuple):
    kind: str  # "F" | "B" | "W"
    mb: int  # micro-batch index

    def __str__(self) -> str:  # noqa: D105
        return f"{self.kind}{self.mb}"


def parse_op(text: str) -> Op:
    """``"B5"`` -> ``Op("B", 5)``; raises ValueError naming the text otherwise."""
    m = _OP_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"'{text}' is not an op: write F<m>, B<m> or W<m>, e.g. F3")
    return Op(m.group(1), int(m.group(2)))


def parse_stage(texts: list[str]) -> list[Op]:
    return [parse_op(t) for t in texts]


def format_stage(ops: list[Op]) -> list[str]:
    return [str(o) for o in ops]
