"""One op type for compute and communication, one parse and one format.

Kinds: ``F`` forward, ``B`` backward-input (gradient w.r.t. the stage input), ``W`` backward-weight;
``SEND_F`` / ``RECV_F`` carry the activation of a micro-batch from stage s to s+1, ``SEND_B`` /
``RECV_B`` its input gradient from stage s to s-1. Text is spelled like torch pipelining's
``_Action``: ``[stage]KIND[micro-batch]``, e.g. ``2SEND_F5`` (stage 2 sends the activation of
micro-batch 5 to stage 3) or ``0F1``. Without a stage the text is stage-local, as in plan files:
``F3``, ``B3``, ``W3``, ``SEND_F3``. (torch calls the backward-input ``I`` and a fused backward
``B``; ``plan.torch_csv`` translates.)

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

KINDS = ("F", "B", "W")  # compute: what a plan file lists
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
ALL_KINDS = KINDS + COMM_KINDS
_OP_RE = re.compile(r"^(\d+)?(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)$")


class Op(NamedTuple):
    kind: str  # one of ALL_KINDS
    mb: int  # micro-batch index
    stage: Optional[int] = None  # None: stage-local (the stage is the row the op sits in)

    def __str__(self) -> str:  # noqa: D105
        return f"{'' if self.stage is None else self.stage}{self.kind}{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in KINDS

    @property
    def peer(self) -> Optional[int]:
        """The stage at the other end of a send or receive (None for compute or stage-local ops).

        Activations flow down (stage s to s+1), input gradients up (s to s-1)."""
        if self.stage is None or self.kind in KINDS:
            return None
        return self.stage + (1 if self.kind in ("SEND_F", "RECV_B") else -1)

    def at(self, stage: int) -> "Op":
        """The same op placed on ``stage`` (global form, printed with its stage)."""
        return Op(self.kind, self.mb, stage)

    def local(self) -> "Op":
        """The same op without its stage (the form a plan file lists)."""
        return Op(self.kind, self.mb)


def parse_op(text: str) -> Op:
    """``"B5"`` -> ``Op("B", 5)``, ``"2SEND_F5"`` -> ``Op("SEND_F", 5, 2)``; raises ValueError naming
    the text otherwise."""
    m = _OP_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"'{text}' is not an op: write [stage]KIND<m>, e.g. F3 or 2SEND_F5")
    return Op(m.group(2), int(m.group(3)), None if m.group(1) is None else int(m.group(1)))


_TEXTS: dict = {}  # op -> its text: plans repeat the same few thousand ops
_CACHE_MAX = 1 << 20


def parse_stage(texts: list[str]) -> list[Op]:
    return [parse_op(t) for t in texts]


def format_stage(ops: list[Op]) -> list[str]:
    get = _TEXTS.get
    out = [get(o) if type(o) is Op else None for o in ops]
    if None in out:
        if len(_TEXTS) > _CACHE_MAX:
            _TEXTS.clear()
        for i, o in enumerate(ops):
            if out[i] is None:
                out[i] = str(o)
                if type(o) is Op:
                    _TEXTS[o] = out[i]
    return out
