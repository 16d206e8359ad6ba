"""One op type for compute and communication, one parse and one format; a schedule is rows of ops.

Kinds (``Kind``): ``F`` forward, ``B`` backward-input (gradient w.r.t. the stage input), ``W``
backward-weight; ``SEND_F`` / ``RECV_F`` carry the activation of a micro-batch from stage s to s+1,
``SEND_B`` / ``RECV_B`` its input gradient from stage s to s-1; ``Kind.F.send``,
``Kind.RECV_B.payload`` and the like map between them. ``Kind`` is a ``TextEnum`` (a ``StrEnum``
that runs on Python 3.9): a kind equals its text (``Kind.F == "F"``), so plan files and op texts
read and write as before; the package itself compares kinds, never texts
(tests/plan/test_kind_language.py). Text is spelled like torch pipelining's ``_Action``:
``[stage]KIND[micro-batch]``, e.g. ``2SEND_F5`` (stage 2 sends the activation of micro-batch 5 to
stage 3) or ``0F1``. Without a stage the text is stage-local, as in plan files and op records:
``F3``, ``B3``, ``W3``, ``SEND_F3``. ``parse_op``, ``recorded_op`` and ``str(op)`` are the one
parser and printer of that text (plans, op records and traces all use them). (torch calls the
backward-input ``I`` and a fused backward ``B``; ``plan.files.torch_csv`` translates.)

A ``Schedule`` is one row per stage of that stage's compute ops in execution order (what a plan
file lists); ``peak_inflight`` and ``warmup_counts`` read the two counts a plan is judged by off it.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple, Optional

from .text_enum import TextEnum


class Kind(TextEnum):
    """What an op does. Compute kinds first, in the order of their per-stage times (F, B, W).

    The kinds that travel are named after what they carry: ``SEND_F`` sends the activation an ``F``
    produced, ``RECV_B`` receives the input gradient a ``B`` produced. The mappings between them are
    members, never text: ``Kind.F.send is Kind.SEND_F``, ``Kind.RECV_B.payload is Kind.B``,
    ``Kind.SEND_F.recv is Kind.RECV_F`` (the receive that pairs with a send)."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    code: int  # 0, 1, 2 for F, B, W (compute kinds only; set below): the kind's code in ``op_table``,
    # the compiled replay and the position of its time in a stage's (F, B, W) times. A plain
    # attribute, not a property: simulators read it once per op.

    @property
    def is_compute(self) -> bool:
        return self in KINDS

    @property
    def is_send(self) -> bool:
        return self is Kind.SEND_F or self is Kind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self is Kind.RECV_F or self is Kind.RECV_B

    @property
    def is_comm(self) -> bool:
        return self.is_send or self.is_recv

    @property
    def payload(self) -> "Kind":
        """What a message of this kind carries, as the compute kind producing it: ``F`` (an
        activation, flowing to the next stage) or ``B`` (an input gradient, flowing to the previous
        one). ``F`` and ``B`` are their own payload; a ``W`` sends nothing."""
        p = _PAYLOAD.get(self)
        if p is None:
            raise ValueError(f"{self} carries no message")
        return p

    @property
    def send(self) -> "Kind":
        """The send of this kind's payload (``Kind.F.send is Kind.SEND_F``)."""
        return _SEND[self.payload]

    @property
    def recv(self) -> "Kind":
        """The receive of this kind's payload (``Kind.B.recv is Kind.RECV_B``)."""
        return _RECV[self.payload]

    @property
    def downstream(self) -> bool:
        """Whether this kind's message flows to the next stage (an activation) rather than the
        previous one (an input gradient)."""
        return self.payload is Kind.F


KINDS = (Kind.F, Kind.B, Kind.W)  # compute: what a plan file lists
COMM_KINDS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
ALL_KINDS = KINDS + COMM_KINDS
PAYLOADS = (Kind.F, Kind.B)  # what travels between stages: activations, input gradients
for _code, _kind in enumerate(KINDS):
    _kind.code = _code
_SEND = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}
_RECV = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}
_PAYLOAD = {Kind.F: Kind.F, Kind.B: Kind.B, **{v: k for k, v in _SEND.items()}, **{v: k for k, v in _RECV.items()}}
_KIND_OF = {k.value: k for k in Kind}  # text (or kind) -> kind: a dict lookup, not Enum.__call__
# The op-text grammar, the one place it is written: [stage]KIND<micro-batch>; longest kinds first.
_OP_RE = re.compile(r"^(\d+)?(%s)(\d+)$" % "|".join(sorted(_KIND_OF, key=len, reverse=True)))


class _OpFields(NamedTuple):
    kind: Kind
    mb: int  # micro-batch index
    stage: Optional[int] = None  # None: stage-local (the stage is the row the op sits in)


class Op(_OpFields):
    """An op: its ``Kind``, micro-batch and (optionally) stage. The kind may be given as its text
    (``Op("F", 3)``); it is stored as the ``Kind``, and anything else is refused."""

    __slots__ = ()

    def __new__(cls, kind, mb: int, stage: Optional[int] = None) -> "Op":
        try:
            kind = _KIND_OF[kind]
        except (KeyError, TypeError):
            raise ValueError(f"{kind!r} is not an op kind: one of {', '.join(ALL_KINDS)}") from None
        return tuple.__new__(cls, (kind, mb, stage))

    @classmethod
    def _make(cls, iterable) -> "Op":
        return cls(*iterable)

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
        return self.stage + (1 if self.kind in (Kind.SEND_F, Kind.RECV_B) else -1)

    def at(self, stage: int) -> "Op":
        """The same op placed on ``stage`` (global form, printed with its stage)."""
        return Op(self.kind, self.mb, stage)

    def local(self) -> "Op":
        """The same op without its stage (the form a plan file lists)."""
        return Op(self.kind, self.mb)


Schedule = list[list[Op]]  # per stage, its compute ops in execution order


def parse_op(text: str) -> Op:
    """``"B5"`` -> ``Op(Kind.B, 5)``, ``"2SEND_F5"`` -> ``Op(Kind.SEND_F, 5, 2)``; raises ValueError
    naming the text otherwise."""
    m = _OP_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"'{text}' is not an op: write [stage]KIND<m>, e.g. F3 or 2SEND_F5")
    stage = m.group(1)
    return tuple.__new__(Op, (_KIND_OF[m.group(2)], int(m.group(3)), None if stage is None else int(stage)))


def message_op(kind, mb: int, sending: bool, stage: Optional[int] = None) -> Op:
    """The send (``sending``) or receive of message ``(kind, mb)``, ``kind`` the payload (``Kind.F``,
    ``Kind.B`` or its text): ``message_op(Kind.B, 3, True)`` prints ``SEND_B3``."""
    k = _KIND_OF[kind]
    return Op(k.send if sending else k.recv, mb, stage)


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


@lru_cache(maxsize=8)
def op_table(n: int) -> tuple[tuple[Op, ...], dict]:
    """The compute ops of n micro-batches by code (``KINDS`` position * n + m), and codes by op:
    one shared object per op (the compiled core's encoding; schedules built from it compare fast)."""
    ops = tuple(Op(k, m) for k in KINDS for m in range(n))
    return ops, {op: i for i, op in enumerate(ops)}


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per stage, the most activations held at once (F done, B not yet done), from the order."""
    out = []
    for row in schedule:
        cur = peak = 0
        for op in row:
            k = op.kind
            if k is Kind.F:
                cur += 1
                if cur > peak:
                    peak = cur
            elif k is Kind.B:
                cur -= 1
        out.append(peak)
    return out


def warmup_counts(schedule: Schedule) -> list[int]:
    """Forwards each stage runs before its first B (x_s)."""
    out = []
    for row in schedule:
        n = 0
        for op in row:
            if op.kind is Kind.B:
                break
            n += op.kind is Kind.F
        out.append(n)
    return out


_RECORDED: dict = {}  # record text -> its op (or None): an engine records the same few hundred texts


def recorded_op(text: str) -> Optional[Op]:
    """The plan op an op record's text names (``"SEND_F3"`` -> ``Op(Kind.SEND_F, 3)``, stage-local),
    or None for the engine's other instructions (``"ReduceGrads"``, ``"OptimizerStep"``, ...). The
    one parse of record texts; cached."""
    try:
        return _RECORDED[text]
    except KeyError:
        pass
    m = _OP_RE.match(text)
    op = None if m is None or m.group(1) is not None else Op(m.group(2), int(m.group(3)))
    if len(_RECORDED) < _CACHE_MAX:
        _RECORDED[text] = op
    return op
