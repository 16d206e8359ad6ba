"""How a delegated transport's bytes move between its tensors and the staging slots (PipeMorph §5.2).

``select_path(device)`` is the one rule, applied once per transport to the device its tensors live on (the
engine's): a CUDA device takes ``CudaPath``, anything else ``HostPath``. It reads only ``device.type`` and
``device.index`` and touches no CUDA API, so it decides the same on a machine without a GPU.

- ``HostPath``: the tensors are on the CPU; the copy thread memcpys a message into its slots and the prefetch
  thread memcpys it out (an accelerator other than CUDA is copied to the host on the calling thread first).
- ``CudaPath``: the ring is pinned (``cudaHostRegister``). A send records an event on the compute stream and
  returns; the copy thread makes a side stream wait on that event, enqueues the device-to-host copies into the
  slot (``cudaMemcpyAsync``) and then a stream callback (``cudaLaunchHostFunc``) that publishes the slot to the
  delegate. A receive enqueues the host-to-device copies on a second side stream, then a callback that frees
  the slot; the consumer's stream waits on an event recorded after them. No thread waits for a copy.

Both paths have the same surface, used by ``runtime/transport/delegated/``:

- training thread: ``outgoing(t)``, then ``sent(tensors)`` (a "ready" marker for the copy thread), and
  ``hand_over(tensors, ready)`` on a received message;
- copy thread: ``with sending(ready):`` around a message, ``with writing(ring, nbytes, tag, timeout_s) as
  (view, spans):`` per slot;
- receiving thread: ``with receiving():`` around taking a piece, ``with reading(ring, timeout_s) as (view, tag,
  spans):`` per slot, ``recv_device`` for new tensors, ``received()`` once a message is complete.

``spans`` is None on the host path; on the CUDA path, device bytes are not copied by the caller but listed as
``(slot offset, device address, bytes)`` and copied asynchronously when the block ends.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .pages import release_pages


def uses_cuda(device: Any) -> bool:
    """True exactly when tensors on ``device`` (a ``torch.device``, a device string or anything with a
    ``type`` attribute) live on a CUDA device."""
    kind = device if isinstance(device, str) else getattr(device, "type", "")
    return str(kind).split(":", 1)[0] == "cuda"


def select_path(device: Any) -> HostPath | CudaPath:
    """The staging data path of a transport whose tensors live on ``device`` (None: the CPU)."""
    if device is None:
        return HostPath(torch.device("cpu"))
    if isinstance(device, str):
        device = torch.device(device)
    return CudaPath(getattr(device, "index", None)) if uses_cuda(device) else HostPath(device)


class HostPath:
    """Tensors on the host: plain memcpy into and out of the slots, done by the transport's threads."""

    cuda = False

    def __init__(self, device: Any):
        self.device = device  # where received tensors go (the CPU, or a non-CUDA accelerator)
        self.recv_device = torch.device("cpu")
        self.release = False  # give a slot's pages back once its bytes are taken out (``staging.pages``)

    def pin(self, ring: Any) -> None:
        """Nothing to pin: only DMA needs page-locked memory."""

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        # A tensor of a non-CUDA accelerator is copied to the host here, on the calling thread.
        return t.detach().contiguous().cpu()

    def sent(self, tensors: Sequence[torch.Tensor]) -> None:
        return None

    @contextlib.contextmanager
    def sending(self, ready: Any) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def writing(self, ring: Any, nbytes: int, tag: int, timeout_s: float) -> Iterator[tuple[torch.Tensor, None]]:
        with ring.writing(torch.uint8, [nbytes], tag, timeout_s=timeout_s) as view:
            yield view, None

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def reading(self, ring: Any, timeout_s: float) -> Iterator[tuple[torch.Tensor, int, None]]:
        with ring.reading(timeout_s=timeout_s) as (view, tag):
            yield view, tag, None
            if self.release:  # taken out: its pages leave both processes before the slot goes back
                release_pages(view.data_ptr(), view.numel() * view.element_size())

    def received(self) -> None:
        return None

    def hand_over(self, tensors: list, ready: Any) -> list:
        if self.device.type == "cpu":
            return tensors
        return [t.to(self.device) for t in tensors]


class CudaPath:
    """Tensors on CUDA device ``index`` (None: the current one when first used): asynchronous copies on two side
    streams (device-to-host for sends, host-to-device for receives), made on first use."""

    cuda = True

    def __init__(self, index: int | None):
        self.index = index
        self._lock = threading.Lock()
        self._device: torch.device | None = None
        self._streams: tuple[Any, Any] | None = None

    @property
    def recv_device(self) -> torch.device:
        return self._dev()

    def _dev(self) -> torch.device:
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device() if self.index is None else self.index)
        return self._device

    def streams(self) -> tuple[Any, Any]:
        """(send stream, receive stream), created once (the copy thread and the prefetch thread may race)."""
        with self._lock:
            if self._streams is None:
                dev = self._dev()
                self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
            return self._streams

    def pin(self, ring: Any) -> None:
        """Page-lock the ring now (at link start), not inside the first copy."""
        with torch.cuda.device(self._dev()):
            ring.pin()

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        # Stays where it is: a CUDA tensor is copied by the copy stream, a host one (rare) memcpy'd into the slot.
        t = t.detach()
        if t.is_cuda and t.device != self._dev():
            raise ValueError(f"a message tensor lives on {t.device}, the transport's staging copies run on "
                             f"{self._dev()}: move it to the stage's device")
        return t.contiguous()  # on the compute stream, like the kernel that produced t

    def sent(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Mark the message ready on the compute stream (an event after the kernels that produced it) and tell
        the caching allocator that the send stream uses its tensors. Returns at once."""
        if not any(t.is_cuda for t in tensors):
            return None
        send, _ = self.streams()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._dev()))
        for t in tensors:
            if t.is_cuda:
                t.record_stream(send)
        return ready

    @contextlib.contextmanager
    def sending(self, ready: Any) -> Iterator[None]:
        send, _ = self.streams()
        with torch.cuda.stream(send):
            if ready is not None:
                send.wait_event(ready)  # the copies start after the producing kernels, the host never waits
            yield

    @contextlib.contextmanager
    def writing(self, ring: Any, nbytes: int, tag: int, timeout_s: float) -> Iterator[tuple[torch.Tensor, list]]:
        send, _ = self.streams()
        with ring.writing_async(nbytes, tag, send, timeout_s=timeout_s) as (view, spans):
            yield view, spans

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        # New tensors and the copies into them belong to the receive stream; hand_over moves them on.
        _, recv = self.streams()
        with torch.cuda.stream(recv):
            yield

    @contextlib.contextmanager
    def reading(self, ring: Any, timeout_s: float) -> Iterator[tuple[torch.Tensor, int, list]]:
        _, recv = self.streams()
        with ring.reading_async(recv, timeout_s=timeout_s) as (view, tag, spans):
            yield view, tag, spans

    def received(self) -> Any:
        """An event after every copy of the message enqueued so far on the receive stream."""
        _, recv = self.streams()
        done = torch.cuda.Event()
        done.record(recv)
        return done

    def hand_over(self, tensors: list, ready: Any) -> list:
        """Make the consumer's (current) stream wait for the copies, on the device, not on the host."""
        if ready is not None:
            current = torch.cuda.current_stream(self._dev())
            current.wait_event(ready)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(current)
        return tensors
