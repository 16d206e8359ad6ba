"""Host-staged point-to-point messages under gloo: a shim of the GPU check's harness, not of the package.

Why it exists: gloo has no CUDA point-to-point (its ``send``/``recv``/``isend``/``irecv`` take CPU
tensors only), and the GPU check runs 4 ranks on one GPU, where NCCL (one GPU per rank) cannot be
used, so every rank runs gloo with its model on cuda:0. DeepSpeed's ``PipelineEngine`` sends a CUDA
tensor point to point already in its constructor (``p2p.send(self.loss, ...)``), then every
activation and gradient (``_exec_send/recv_*`` through ``p2p.send``/``p2p.recv``, the tensor meta,
``p2p.send_obj``/``recv_obj``); all of these reach ``torch.distributed.send``/``recv``/``isend``/``irecv``
through ``deepspeed.comm``, as does ``DirectTransport``.

``install()`` wraps those four functions of ``torch.distributed``. When the message's tensor is on the
GPU and its group's backend is gloo, a send copies the tensor to a CPU tensor and sends that; a receive
receives into a CPU buffer and copies it into the device tensor (``recv`` on return, ``irecv`` once its
work is waited for or seen completed). Every other call passes through unchanged. It is installed the
same way for the stock DeepSpeed runs and the PipeMorphEngine runs, so both pay the same host round
trips and the comparison stays fair. Collectives are not wrapped: gloo has CUDA all-reduce, broadcast
and all-gather.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.distributed as dist

P2P_FUNCTIONS = ("send", "recv", "isend", "irecv")
STAGED = dict.fromkeys(P2P_FUNCTIONS, 0)  # messages staged through host memory, per function
_ORIGINAL: dict[str, Callable] = {}


def cuda_on_gloo(tensor: torch.Tensor, group) -> bool:
    """The default test: a CUDA tensor in a gloo group."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


class StagedWork:
    """An ``isend``/``irecv`` work whose message went through a host tensor: waiting for it (or seeing
    it completed) copies a received message into the device tensor, once."""

    def __init__(self, work, host: torch.Tensor, device_tensor: Optional[torch.Tensor]):
        self._work, self._host, self._into = work, host, device_tensor  # the host tensor lives as long as the work

    def _finish(self) -> None:
        if self._into is not None:
            self._into.copy_(self._host)
            self._into = None

    def wait(self, *args, **kwargs):
        ok = self._work.wait(*args, **kwargs)
        if ok is not False:
            self._finish()
        return ok

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._finish()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _staged(name: str, original: Callable, needs_staging: Callable) -> Callable:
    signature = inspect.signature(original)
    receiving, asynchronous = name in ("recv", "irecv"), name.startswith("i")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments["tensor"]
        if not needs_staging(tensor, bound.arguments.get("group")):
            return original(*args, **kwargs)
        host = torch.empty_like(tensor, device="cpu") if receiving else tensor.detach().to("cpu", copy=True)
        bound.arguments["tensor"] = host
        STAGED[name] += 1
        result = original(*bound.args, **bound.kwargs)
        if asynchronous:
            return None if result is None else StagedWork(result, host, tensor if receiving else None)
        if receiving:
            tensor.copy_(host)
        return result

    wrapper.host_staged = True
    return wrapper


def install(needs_staging: Callable[[torch.Tensor, object], bool] = cuda_on_gloo) -> None:
    """Wrap ``torch.distributed``'s point-to-point functions (again with another test: the tests force
    staging of CPU tensors to exercise the copies without a GPU)."""
    for name in P2P_FUNCTIONS:
        original = _ORIGINAL.setdefault(name, getattr(dist, name))
        setattr(dist, name, _staged(name, original, needs_staging))


def uninstall() -> None:
    for name, original in _ORIGINAL.items():
        setattr(dist, name, original)
