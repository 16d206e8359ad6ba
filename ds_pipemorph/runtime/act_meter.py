"""Activation memory in bytes: what autograd holds for the backward, measured as it runs.

``SavedBytes`` is a context (``torch.autograd.graph.saved_tensors_hooks``) that counts every tensor
a graph saves for its backward while the graph holds it: a storage counts once however many nodes
save it (or views of it), from the first save until the last node holding it releases it (the
graph freed by a backward without ``retain_graph``, or dropped). Parameters are not activations:
their storages (and those of views of them, such as a transposed weight) are left out. ``live`` is
what is held now, ``peak`` the most held at once since the context opened. The meter holds each
saved tensor detached (as autograd holds a node's saved outputs: without their ``grad_fn``), so
that measuring changes no lifetime.

The same meter runs around stock DeepSpeed's ``train_batch`` and the engine's, so both are counted
alike (``tests/runtime/test_memory.py``); the engine measures its first iteration with it
(``ActivationBytes``: per micro-batch, what F leaves for B and what B leaves for W).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch


class _Held:
    """A saved tensor, as the graph holds it: dropping it releases its storage's count."""

    __slots__ = ("t", "meter", "key")

    def __init__(self, t: torch.Tensor, meter: "SavedBytes", key: int):
        self.t, self.meter, self.key = t, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedBytes:
    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {_key(t) for t in exclude}
        self._refs: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self._ctx: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "SavedBytes":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, t: torch.Tensor):
        key = _key(t)
        if key in self._skip or key == 0:
            return t
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += ref[1]
            if self.live > self.peak:
                self.peak = self.live
        ref[0] += 1
        # Detached: the saved output of a node would otherwise hold that node through its grad_fn,
        # a cycle through C++ that Python's collector cannot break (the graph would never be freed).
        return _Held(t.detach(), self, key)

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]


def _unpack(packed):
    return packed.t if isinstance(packed, _Held) else packed


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some wrappers)
        return 0


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = 0 if t is None else _key(t)
        if key:  # (no storage: nothing to count, as the meter counts nothing for it)
            seen.setdefault(key, t.untyped_storage().nbytes())
    return sum(seen.values())
