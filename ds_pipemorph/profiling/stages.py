"""Time F, B and W of every stage of a model in this process, one stage after the other.

For each stage the sample micro-batch is first carried through the earlier stages (no grad) to
get that stage's real input. Then ``warmup`` untimed and ``reps`` timed rounds of:

- F: the stage's forward with autograd recording (on the last stage including ``loss_fn(output,
  labels)`` when the model has a loss function and the sample has labels);
- B: the gradient w.r.t. the stage input, given an output gradient (random normal of the output's
  shape; ones for the loss);
- W: the gradient w.r.t. the stage's parameters.

B and W are split as the engine splits them (``split="runtime"``): ``ds_pipemorph.runtime.bw_split``'s
``backward_input`` (B, capturing the gradients at the frontier nodes) and ``WeightGradWork.run`` (W,
re-entering the graph there), so nothing is computed twice and the times are the engine's. The first
stage's input (data) needs no gradient, so its B is (close to) zero and its W is its whole backward,
as in the engine. ``split="autograd"`` (used when the runtime's split cannot be imported, or on
request) calls ``torch.autograd.grad`` with ``inputs=`` the stage input (B, keeping the graph) and
then the parameters (W). That W is an approximation: autograd walks the input path of the graph
again, so W is over-estimated by up to B.

Each time is the median of the timed rounds, in ms; on CUDA the device is synchronised around each op.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..fileio import BadInput, first_line


@dataclass(frozen=True)
class StageTimes:
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    params: int
    # Saved activations of one micro-batch (``runtime.act_meter``): what F leaves for B and what B
    # leaves for W (freed by W), in bytes; 0 under the autograd split (not measured).
    activation_bytes: int = 0
    weight_bytes: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    raise BadInput(f"a stage returned {type(x).__name__}; stages pass tensors or tuples of tensors")


def _stage_input(x, needs_grad: bool):
    """A fresh leaf copy of a stage input; floating tensors require grad unless this is the first stage."""
    def leaf(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach().clone()
        return t.requires_grad_(True) if needs_grad and t.is_floating_point() else t
    return leaf(x) if isinstance(x, torch.Tensor) else type(x)(leaf(t) for t in x)


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(t, device) for t in x)
    return x


def _split_available() -> bool:
    try:
        from ..runtime.bw_split import backward_input  # noqa: F401
    except ImportError:
        return False
    return True


def time_stage(module: torch.nn.Module, inputs, *, first: bool, loss: Optional[Callable] = None,
               warmup: int = 2, reps: int = 5, split: str = "runtime",
               device: torch.device = torch.device("cpu"), grads: Optional[list] = None) -> StageTimes:
    """Median F, B and W times (ms) of ``module`` on ``inputs``; ``loss(output)`` makes a scalar loss.

    The output gradients are ``grads``, or drawn once after the first F, outside every timed span
    (drawing random normals costs about 1 ms per MB on one CPU thread: inside B's span it would
    weigh as much as a small layer's backward)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if split == "runtime":
        from ..runtime.bw_split import backward_input
    f_ms, b_ms, w_ms = [], [], []
    for i in range(warmup + reps):
        for p in params:
            p.grad = None
        x = _stage_input(inputs, needs_grad=not first)
        _sync(device)
        t0 = time.perf_counter()
        out = module(x)
        if loss is not None:
            out = loss(out)
        _sync(device)
        t1 = time.perf_counter()
        outs = [o for o in _tensors(out) if o.requires_grad]
        if not outs:
            raise BadInput("a stage output does not depend on any parameter or input that needs a gradient")
        tb = t1  # B's span starts here: after the gradients are drawn, if they are drawn now
        if grads is None:  # once, in no timed span
            grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
            tb = time.perf_counter()
        xin = [t for t in _tensors(x) if t.requires_grad]
        if split == "runtime":
            _, work = backward_input(outs, grads, xin, params)
            _sync(device)
            t2 = time.perf_counter()
            work.run()
        else:
            if xin:
                torch.autograd.grad(outs, xin, grads, retain_graph=True, allow_unused=True)
            _sync(device)
            t2 = time.perf_counter()
            if params:
                torch.autograd.grad(outs, params, grads, allow_unused=True)
        _sync(device)
        t3 = time.perf_counter()
        if i >= warmup:
            f_ms.append((t1 - t0) * 1e3)
            b_ms.append((t2 - tb) * 1e3)
            w_ms.append((t3 - t2) * 1e3)
        del out, outs, x, xin
    f_bytes, w_bytes = _saved_bytes(module, inputs, first, loss, params, grads) if split == "runtime" else (0, 0)
    return StageTimes(statistics.median(f_ms), statistics.median(b_ms), statistics.median(w_ms),
                      sum(p.numel() for p in params), f_bytes, w_bytes)


def _saved_bytes(module, inputs, first: bool, loss, params, grads) -> tuple[int, int]:
    """One more untimed round under ``SavedBytes``: what F saved, and what W freed of it once B ran
    and released its outputs (as the engine does)."""
    from ..runtime.act_meter import SavedBytes
    from ..runtime.bw_split import backward_input

    for p in params:
        p.grad = None
    with SavedBytes(params) as meter:
        x = _stage_input(inputs, needs_grad=not first)
        out = module(x)
        if loss is not None:
            out = loss(out)
        f = meter.live
        outs = [o for o in _tensors(out) if o.requires_grad]
        _, work = backward_input(outs, grads, [t for t in _tensors(x) if t.requires_grad], params)
        del out, outs, x
        held = meter.live
        work.run()
        del work
        return f, held - meter.live


def profile_stages(modules: Sequence[torch.nn.Module], inputs, labels=None, loss_fn: Optional[Callable] = None,
                   *, warmup: int = 2, reps: int = 5, split: Optional[str] = None,
                   device: torch.device = torch.device("cpu"),
                   on_stage: Callable[[int], None] = lambda s: None) -> tuple[list[StageTimes], str]:
    """Times of every stage, and the split used ("runtime" or "autograd"; None picks runtime if present)."""
    if split is None:
        split = "runtime" if _split_available() else "autograd"
    x = _to(inputs, device)
    labels = _to(labels, device)
    loss = (lambda out: loss_fn(out, labels)) if loss_fn is not None and labels is not None else None
    times = []
    for s, m in enumerate(modules):
        m.to(device).train()
        last = s == len(modules) - 1
        try:
            times.append(time_stage(m, x, first=s == 0, loss=loss if last else None, warmup=warmup, reps=reps,
                                    split=split, device=device))
            if not last:
                with torch.no_grad():
                    x = m(x)
        except BadInput as e:
            raise BadInput(f"stage {s}: {e}") from None
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            msg = first_line(e)
            raise BadInput(f"stage {s} failed on its sample input: {type(e).__name__}: {msg}") from None
        on_stage(s)
    return times, split
