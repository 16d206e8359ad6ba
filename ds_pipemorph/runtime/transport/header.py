"""The layout header of a message and the wire ids of message kinds, shared by both transports.

A message is a tensor or a tuple of tensors; before its tensors' bytes the receiver needs to know
how to allocate them. ``encode_header`` packs that into a fixed-size int64 tensor (bare tensor or
tuple, count, then dtype id, ndim and shape per tensor) and ``decode_header`` reads it back. The
direct transport sends it as its own message (tagged with ``tag``); the delegated transport puts it
at the start of every message's first staging slot.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...plan.ir.ops import Kind
from .protocol import TransportError

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]
_DTYPE_ID = {d: i for i, d in enumerate(DTYPES)}
HEADER_INTS = 64
KINDS = {Kind.F: 1, Kind.B: 2}  # wire ids: activation, input gradient
PARTS = 64  # header + up to 63 tensors per message


def tag(kind: Kind, micro_batch: int, part: int) -> int:
    """The torch.distributed tag of part ``part`` (0: the header, 1..: the tensors) of message (kind, mb)."""
    return (KINDS[kind] << 24) | (micro_batch * PARTS + part)


def untag(wire_tag: int) -> str:
    """What ``tag`` made ``wire_tag`` from, as text: ``F3`` (its header) or ``F3 part 2`` (its 2nd tensor)."""
    kind = {v: k for k, v in KINDS.items()}.get(wire_tag >> 24, "?")
    mb, part = divmod(wire_tag & ((1 << 24) - 1), PARTS)
    return f"{kind}{mb}" + (f" part {part}" if part else " header")


def encode_header(tensors: Sequence[torch.Tensor], bare: bool) -> torch.Tensor:
    """[bare tensor (1) or tuple (0), count, then dtype id, ndim, *shape per tensor]."""
    vals = [int(bare), len(tensors)]
    for t in tensors:
        vals += [_DTYPE_ID[t.dtype], t.dim(), *t.shape]
    if len(vals) > HEADER_INTS or len(tensors) >= PARTS:
        raise TransportError(f"a message of {len(tensors)} tensors with shapes "
                             f"{[tuple(t.shape) for t in tensors]} does not fit the {HEADER_INTS}-int header")
    head = torch.zeros(HEADER_INTS, dtype=torch.int64)
    head[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return head


def decode_header(head: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, list[int]]]]:
    """(bare, [(dtype, shape) per tensor]) from a header made by ``encode_header``."""
    vals = head.tolist()
    n, i, out = vals[1], 2, []
    for _ in range(n):
        dtype, nd = DTYPES[vals[i]], vals[i + 1]
        out.append((dtype, vals[i + 2: i + 2 + nd]))
        i += 2 + nd
    return bool(vals[0]), out
