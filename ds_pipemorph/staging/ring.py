"""``StagingRing``: one end (producer or consumer) of a shared-memory staging ring.

A ring has one producer and one consumer (one thread each: pushes, or pops, must not race each other); messages are tensors of any dtype and shape with an integer
tag, delivered in FIFO order. The creator owns the name: ``close()`` (or leaving the ``with`` block, or garbage
collection / interpreter exit) unlinks it. Timeouts raise ``TimeoutError`` naming the ring, slot and duration;
a ring /dev/shm has no room for raises the op's ``StagingNoRoomError`` (a RuntimeError).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .builder import StagingRingBuilder, StagingRingCUDABuilder


def op_builder(cuda: bool | None = None) -> StagingRingBuilder | StagingRingCUDABuilder:
    """The builder of the op variant asked for (None: the CUDA one when a GPU is usable)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    return StagingRingCUDABuilder() if cuda else StagingRingBuilder()


def load_op(cuda: bool | None = None) -> Any:
    """The built extension (JIT-built and cached on first use): the CUDA variant when a GPU is usable."""
    return op_builder(cuda).load()


def _finalize(handle: Any, op: Any, name: str, unlink: bool) -> None:
    handle.close()
    if unlink:
        op.unlink(name)


class StagingRing:
    """One end of a ring; make it with ``create`` (owns and unlinks the name) or ``attach``."""

    def __init__(self, handle: Any, op: Any, *, creator: bool):
        self._h = handle
        self._op = op
        self.is_creator = creator
        self.name = handle.name
        self._finalizer = weakref.finalize(self, _finalize, handle, op, handle.name, creator)

    @classmethod
    def create(cls, name: str, *, slot_bytes: int, num_slots: int = 4, op: Any = None) -> StagingRing:
        """Create ring ``name`` with ``num_slots`` slots of ``slot_bytes`` each; fails if the name exists."""
        op = op or load_op()
        return cls(op.Ring.create(name, num_slots, slot_bytes), op, creator=True)

    @classmethod
    def attach(cls, name: str, *, timeout_s: float = 10.0, op: Any = None) -> StagingRing:
        """Attach to ring ``name`` made by another process, waiting up to ``timeout_s`` for it to appear."""
        op = op or load_op()
        return cls(op.Ring.attach(name, timeout_s), op, creator=False)

    @property
    def num_slots(self) -> int:
        return self._h.num_slots

    @property
    def slot_bytes(self) -> int:
        return self._h.slot_bytes

    @property
    def closed(self) -> bool:
        return self._h.closed

    def occupancy(self) -> int:
        """Messages pushed (or being pushed) and not yet popped."""
        return self._h.occupancy()

    def push(self, tensor: torch.Tensor, tag: int = 0, timeout_s: float | None = None) -> None:
        """Copy ``tensor`` into the next free slot (waits up to ``timeout_s`` while the ring is full).

        A CUDA tensor is copied asynchronously on the current stream of its device; push returns at once.
        """
        t = tensor.contiguous()
        if t.is_cuda:
            self._need_cuda("push a CUDA tensor")
            stream = torch.cuda.current_stream(t.device)
            self._h.push_cuda(t, tag, timeout_s, stream.cuda_stream)
        else:
            self._h.push(t, tag, timeout_s)

    def pop(
        self, timeout_s: float | None = None, out: torch.Tensor | None = None, device: Any = None
    ) -> tuple[torch.Tensor, int]:
        """Wait up to ``timeout_s`` (None: forever) for the next message; return ``(tensor, tag)``.

        ``out`` (same dtype and element count) avoids an allocation. With a CUDA ``device`` (or a CUDA ``out``)
        the H2D copy is enqueued on that device's current stream and pop returns at once.
        """
        dev = torch.device(device) if device is not None else (out.device if out is not None else None)
        if dev is not None and dev.type == "cuda":
            self._need_cuda("pop into a CUDA tensor")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(index)
            return self._h.pop_cuda(timeout_s, out, index, stream.cuda_stream)
        return self._h.pop(timeout_s, out)

    def try_pop(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
        """``(tensor, tag)`` if a message is ready now, else None (CPU tensors)."""
        return self._h.try_pop(out)

    @contextlib.contextmanager
    def writing(
        self, dtype: torch.dtype, shape: Sequence[int], tag: int = 0, timeout_s: float | None = None
    ) -> Iterator[torch.Tensor]:
        """Zero-copy push: yields a tensor that IS the next slot; it is published when the block ends.

        Fill it in place (e.g. ``dist.recv(view)`` in a receiver delegate). If the block raises, the slot is given
        back unpublished. Do not keep the tensor after the block: the consumer then owns that memory.
        """
        view, seq = self._h.begin_write(dtype, list(shape), tag, timeout_s)
        try:
            yield view
        except BaseException:
            self._h.abort_write(seq)
            raise
        self._h.end_write(seq)

    @contextlib.contextmanager
    def reading(self, timeout_s: float | None = None) -> Iterator[tuple[torch.Tensor, int]]:
        """Zero-copy pop: yields ``(tensor, tag)`` where the tensor IS the slot; the slot is freed when the block ends.

        Use it in place (e.g. ``dist.send(view)`` in a sender delegate); finish every asynchronous use before the
        block ends. If the block raises, the message is put back and will be read again.
        """
        view, tag, seq = self._h.begin_read(timeout_s)
        try:
            yield view, tag
        except BaseException:
            self._h.abort_read(seq)
            raise
        self._h.end_read(seq)

    # -- CUDA build: asynchronous copies between device memory and the slots (staging/device_path.py) --------
    def pin(self) -> None:
        """Page-lock this process's mapping of the ring (cudaHostRegister), so copies to and from it are DMA."""
        self._need_cuda("pin the ring")
        self._h.pin()

    @contextlib.contextmanager
    def writing_async(
        self, nbytes: int, tag: int, stream: Any, timeout_s: float | None = None
    ) -> Iterator[tuple[torch.Tensor, list]]:
        """Zero-copy push whose device bytes are copied asynchronously: yields ``(view, spans)``, a uint8 tensor
        over the next slot and an empty list.

        Write host bytes into ``view``; append ``(slot offset, device address, bytes)`` to ``spans`` for bytes that
        live on the GPU. When the block ends, their device-to-host copies are enqueued on ``stream`` followed by
        a stream callback that publishes the slot, and the call returns without waiting. The device memory must
        stay valid and unchanged until the copies ran (order ``stream`` after its producer with an event). If the
        block raises, the slot is given back unpublished.
        """
        self._need_cuda("copy from device memory")
        view, seq = self._h.begin_write(torch.uint8, [nbytes], tag, timeout_s)
        spans: list = []
        try:
            yield view, spans
        except BaseException:
            self._h.abort_write(seq)
            raise
        self._h.end_write_cuda(seq, spans, stream.cuda_stream)

    @contextlib.contextmanager
    def reading_async(self, stream: Any, timeout_s: float | None = None) -> Iterator[tuple[torch.Tensor, int, list]]:
        """Zero-copy pop whose bytes are copied to the device asynchronously: yields ``(view, tag, spans)``, a
        tensor over the slot (the message's dtype and shape, as ``reading``) and an empty list.

        Read host bytes (a header) from ``view``; append ``(slot offset, device address, bytes)`` to ``spans`` for
        bytes that go to the GPU. When the block ends, their host-to-device copies are enqueued on ``stream``
        followed by a stream callback that hands the slot back to the producer; the call returns at once. Work on
        another stream must wait on an event recorded on ``stream`` afterwards. If the block raises, the message
        is put back and will be read again.
        """
        self._need_cuda("copy into device memory")
        view, tag, seq = self._h.begin_read(timeout_s)
        spans: list = []
        try:
            yield view, tag, spans
        except BaseException:
            self._h.abort_read(seq)
            raise
        self._h.end_read_cuda(seq, spans, stream.cuda_stream)

    def close(self) -> None:
        """Unmap this end; the creator also unlinks the name. Idempotent."""
        self._finalizer()

    def __enter__(self):  # -> Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.occupancy()}/{self.num_slots} used"
        role = "creator" if self.is_creator else "attached"
        return f"StagingRing({self.name!r}, {role}, {self.num_slots} x {self.slot_bytes} B, {state})"

    def _need_cuda(self, what: str) -> None:
        if not getattr(self._op, "WITH_CUDA", False):
            raise RuntimeError(f"staging ring {self.name!r}: cannot {what}: this ring was opened with the CPU build")
