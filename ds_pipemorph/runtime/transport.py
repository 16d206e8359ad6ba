"""Point-to-point messages between neighbouring stages: non-blocking, tagged, with timeouts.

A message is a tuple of tensors of any dtypes and shapes. It travels as a small fixed-size header
(count, then dtype id, ndim and shape per tensor) followed by one message per tensor, all tagged
with (kind, micro-batch, part), so that sends and receives issued in any order match: the order of
a plan never has to agree with its neighbour's. Sends never block (``isend``; completion is waited
for once per iteration); receives wait with a timeout whose error names the rank, the op, the link
and the peer. A later transport (``delegated``) and delay injection implement the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]
_DTYPE_ID = {d: i for i, d in enumerate(DTYPES)}
HEADER_INTS = 64
KINDS = {"F": 1, "B": 2}  # activation, input gradient
_PARTS = 64  # header + up to 63 tensors per message


class TransportTimeout(RuntimeError):
    """A wait on another process ran out of time."""


class TransportError(RuntimeError):
    """A message that cannot be sent or received as asked."""


def tag(kind: str, micro_batch: int, part: int) -> int:
    return (KINDS[kind] << 24) | (micro_batch * _PARTS + part)


def encode_header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    vals = [len(tensors)]
    for t in tensors:
        vals += [_DTYPE_ID[t.dtype], t.dim(), *t.shape]
    if len(vals) > HEADER_INTS or len(tensors) >= _PARTS:
        raise TransportError(f"a message of {len(tensors)} tensors with shapes "
                             f"{[tuple(t.shape) for t in tensors]} does not fit the {HEADER_INTS}-int header")
    head = torch.zeros(HEADER_INTS, dtype=torch.int64)
    head[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return head


def decode_header(head: torch.Tensor) -> list[tuple[torch.dtype, list[int]]]:
    vals = head.tolist()
    n, i, out = vals[0], 1, []
    for _ in range(n):
        dtype, nd = DTYPES[vals[i]], vals[i + 1]
        out.append((dtype, vals[i + 2: i + 2 + nd]))
        i += 2 + nd
    return out


@dataclass
class _Pending:
    work: object
    keep: object  # tensors that must stay alive until the work completes
    what: str  # e.g. "SEND_F3 on link 1 to stage 2"


class DirectTransport:
    """Messages go straight through torch.distributed (gloo or NCCL) in the training process.

    ``stage_ranks[s]`` is the global rank of stage ``s`` in this process's pipeline.
    """

    name = "direct"

    def __init__(self, rank: int, stage_id: int, stage_ranks: Sequence[int], timeout_s: float = 300.0,
                 device: Optional[torch.device] = None):
        self.rank, self.stage_id = rank, stage_id
        self.stage_ranks = list(stage_ranks)
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self._sends: list[_Pending] = []
        self._headers: dict[tuple[str, int], tuple[object, torch.Tensor]] = {}

    # -- naming -------------------------------------------------------------------------------
    def _peer(self, kind: str, sending: bool) -> int:
        """Stage at the other end: activations flow down, input gradients flow up."""
        down = (kind == "F") == sending
        return self.stage_id + 1 if down else self.stage_id - 1

    def _describe(self, kind: str, mb: int, sending: bool) -> str:
        peer = self._peer(kind, sending)
        link = min(peer, self.stage_id)
        verb, prep = ("SEND", "to") if sending else ("RECV", "from")
        return f"{verb}_{kind}{mb} on link {link} {prep} stage {peer}"

    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise TransportTimeout(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {what}") from None
            raise TransportError(f"rank {self.rank}: {what} failed: {str(e).splitlines()[0]}") from e
        if ok is False:
            raise TransportTimeout(f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {what}")

    # -- interface ----------------------------------------------------------------------------
    def post_recv(self, kind: str, mb: int) -> None:
        """Post the receive of the header of message (kind, mb) ahead of time (idempotent)."""
        key = (kind, mb)
        if key in self._headers:
            return
        src = self.stage_ranks[self._peer(kind, sending=False)]
        head = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
        self._headers[key] = (dist.irecv(head, src=src, tag=tag(kind, mb, 0)), head)

    def send(self, kind: str, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        """Post header and tensors of message (kind, mb) without waiting for the receiver."""
        dst = self.stage_ranks[self._peer(kind, sending=True)]
        what = self._describe(kind, mb, sending=True)
        tensors = [t.detach().contiguous() for t in tensors]
        head = encode_header(tensors).to(self.device)
        self._sends.append(_Pending(dist.isend(head, dst=dst, tag=tag(kind, mb, 0)), head, what))
        for part, t in enumerate(tensors, start=1):
            self._sends.append(_Pending(dist.isend(t, dst=dst, tag=tag(kind, mb, part)), t, what))

    def recv(self, kind: str, mb: int) -> tuple[torch.Tensor, ...]:
        """Wait for message (kind, mb) and return its tensors (freshly allocated, never shared)."""
        self.post_recv(kind, mb)
        work, head = self._headers.pop((kind, mb))
        what = self._describe(kind, mb, sending=False)
        self._wait(work, what)
        src = self.stage_ranks[self._peer(kind, sending=False)]
        out, works = [], []
        for part, (dtype, shape) in enumerate(decode_header(head), start=1):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(t, src=src, tag=tag(kind, mb, part)))
            out.append(t)
        for w in works:
            self._wait(w, what)
        return tuple(out)

    def wait_sends(self) -> None:
        """Wait until the peers have received every message sent so far."""
        pending, self._sends = self._sends, []
        for p in pending:
            self._wait(p.work, p.what + " to be received")

    def close(self) -> None:
        self._sends.clear()
        self._headers.clear()
