"""How one delegated message is laid out as bytes and cut into staging slots.

A message is one flat byte stream: a head of ``HEAD_BYTES`` (``PREFIX_INTS`` ints: magic, message seq,
kind id, micro-batch, total bytes, pieces, piece bytes, 0; then the layout header of
``header.encode_header``) followed by each tensor's bytes, each tensor starting at a multiple of
``ALIGN``. The stream is cut into pieces of at most one slot: piece p holds bytes
[p * piece_bytes, (p + 1) * piece_bytes), ``piece_bytes`` chosen by the sender (``piece_bytes``) and
named in the head. The sender
keeps the message (``Message``) until the receiving side acknowledged it; ``copy_range`` moves the bytes
of one piece between the message's tensors and a slot, in either direction.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ....plan.ir.ops import Kind
from ..header import HEADER_INTS, KINDS

PREFIX_INTS = 8  # [magic, seq, kind, mb, total bytes, pieces, piece bytes, 0] before header.encode_header's ints
HEAD_BYTES = (PREFIX_INTS + HEADER_INTS) * 8  # 576, a multiple of the 64-byte alignment
MAGIC = 0x504D444C  # "PMDL"
ALIGN = 64
MIN_PIECE_BYTES = 256 << 10  # a message is cut no finer than this (``piece_bytes``)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype and device, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Message:
    """A message sent and not yet acknowledged."""

    seq: int
    head: torch.Tensor  # int64 header
    tensors: list  # contiguous tensors (kept until acknowledged)
    what: str
    piece_bytes: int  # where it is cut (``piece_bytes``), also in its head
    ready: Any = None  # the staging path's mark that the tensors are computed (a CUDA event), or None


def layout(head: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """Segments (offset, uint8 view) of the flat byte stream of a message, and its length."""
    segs, off = [(0, _bytes_of(head))], HEAD_BYTES
    for t in tensors:
        b = _bytes_of(t)
        segs.append((off, b))
        off = _align(off + b.numel())
    return segs, off


def tensor_segments(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """``layout`` of a message with these tensors, without the head's segment (the receiving side)."""
    segs, total = layout(torch.zeros(PREFIX_INTS + HEADER_INTS, dtype=torch.int64), tensors)
    return segs[1:], total


def pieces_of(total: int, piece_bytes: int) -> int:
    """Pieces a message of ``total`` bytes is cut into (at least one)."""
    return max(1, -(-total // piece_bytes))


def piece_bytes(total: int, slot_bytes: int, ring_slots: int, fit_ring: bool) -> int:
    """Where a message of ``total`` bytes is cut: whole slots, or, with ``fit_ring``, into at most
    ``ring_slots`` pieces, so that one message of at most ``ring_slots`` x ``slot_bytes`` fills at
    most one queue's ring. A ring's pages are resident only as far as pieces reach (on CPU): a queue's
    ring then holds at most one message's bytes (``ring_slots`` x ``MIN_PIECE_BYTES`` for smaller
    messages), where whole slots let it hold ``ring_slots`` messages. The whole message fits an empty
    ring, so its copy never waits for the message's own delay (a cut finer than the ring would leave
    its last pieces waiting for the delegate that holds its first one for the delay); a queue's next
    message waits until the previous one has left the ring, and k queues keep k messages in flight.
    A piece is never smaller than ``MIN_PIECE_BYTES`` nor larger than a slot."""
    if not fit_ring:
        return slot_bytes
    return min(slot_bytes, max(MIN_PIECE_BYTES, _align(-(-total // ring_slots))))


def make_head(seq: int, kind: str, mb: int, total: int, pieces: int, cut: int, meta: torch.Tensor) -> torch.Tensor:
    """The int64 head of a message: the prefix (``cut``: its piece bytes), then the layout header ``meta``."""
    head = torch.zeros(PREFIX_INTS + HEADER_INTS, dtype=torch.int64)
    head[:7] = torch.tensor([MAGIC, seq, KINDS[kind], mb, total, pieces, cut])
    head[PREFIX_INTS:] = meta
    return head


def read_head(flat: torch.Tensor) -> tuple[tuple[int, int, str, int, int, int, int], torch.Tensor]:
    """``(magic, seq, kind, mb, total bytes, pieces, piece bytes)`` and the layout header, from a
    message's first piece."""
    head = flat[:HEAD_BYTES].clone().view(torch.int64)
    magic, seq, kind_id, mb, total, pieces, cut = head[:7].tolist()
    kind = Kind.F if kind_id == KINDS[Kind.F] else Kind.B
    return (magic, seq, kind, mb, total, pieces, cut), head[PREFIX_INTS:]


def copy_range(segs, a: int, b: int, piece: torch.Tensor, into_piece: bool, spans: list | None = None) -> None:
    """Copy the bytes [a, b) of the flat stream between the segments and ``piece`` (its bytes a..b).

    With ``spans`` (``piece`` is a staging slot on the CUDA path), a segment in device memory is not copied here
    but listed as (slot offset, device address, bytes) for the asynchronous copy that ends the slot."""
    for off, seg in segs:
        lo, hi = max(a, off), min(b, off + seg.numel())
        if lo >= hi:
            continue
        if spans is not None and seg.is_cuda:
            spans.append((lo - a, seg.data_ptr() + (lo - off), hi - lo))
        elif into_piece:
            piece[lo - a: hi - a].copy_(seg[lo - off: hi - off])
        else:
            seg[lo - off: hi - off].copy_(piece[lo - a: hi - a])
