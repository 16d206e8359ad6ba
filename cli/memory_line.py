"""The line ``plan`` and ``simulate`` print about a plan's activation memory."""
from __future__ import annotations

import math

from ds_pipemorph.plan.ir.memory import peak_units, stock_units
from ds_pipemorph.plan.ir.profile import Profile


def memory_line(prof: Profile, sched) -> str:
    """The plan's predicted peak activation memory per stage: in MB when the profile has the bytes
    (``memory.activation_mb``, ``weight_mb``), else in micro-batches; against stock 1F1B's."""
    share = prof.w_share()
    units = peak_units(sched, share)
    stock = stock_units(prof.stages)
    need = max(u / k for u, k in zip(units, stock))
    m = prof.memory
    if m is not None and m.activation_mb is not None:
        mb = lambda xs: "[" + ", ".join(f"{x:.1f}" for x in xs) + "]"  # noqa: E731
        text = (f"activation memory: peak {mb(u * a for u, a in zip(units, m.activation_mb))} MB per stage "
                f"(capacity {mb(m.capacity_mb)}; stock 1F1B {mb(k * a for k, a in zip(stock, m.activation_mb))})")
    else:
        text = (f"activation memory: peak {[round(u, 2) for u in units]} micro-batches' activations per stage "
                f"(stock 1F1B {stock}; W counted as keeping all of F's graph)")
    if need > 1 + 1e-6:
        text += (f"; {math.ceil(need * 100) / 100:g}x stock's on its fullest stage (the engine runs a plan file as "
                 f"written; with a smaller pipemorph.memory.budget it moves Ws earlier and refuses a deeper warm-up)")
    return text
