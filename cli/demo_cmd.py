"""``pipemorph demo``: a pipeline under a slow link, stock schedules vs PipeMorph, in one table."""
from __future__ import annotations

import typer
from rich.table import Table

from ds_pipemorph.plan.baselines import deepspeed_1f1b, zb_h1
from ds_pipemorph.plan.profile import Costs
from ds_pipemorph.plan.search import search
from ds_pipemorph.plan.simulate import replay

from .common import console, user_errors


def demo(
    stages: int = typer.Option(4, min=2, help="Pipeline stages."),
    microbatches: int = typer.Option(32, min=1, help="Micro-batches per iteration."),
    op_ms: float = typer.Option(10.0, min=0.1, help="Time of each F, B and W in ms."),
    delay_ms: float = typer.Option(60.0, min=0.0, help="Injected one-way delay on the slow link."),
    link: int = typer.Option(-1, help="Slow link (i joins stage i and i+1); -1 = the last one."),
) -> None:
    """Replay stock 1F1B, static ZB-H1 and a PipeMorph plan under one slow link (simulated)."""
    with user_errors():
        link = link if link >= 0 else stages - 2
        if not 0 <= link < stages - 1:
            raise ValueError(f"--link: {link} is not a link of {stages} stages (0..{stages - 2})")
        n = microbatches
        calm = Costs.uniform(stages, op_ms)
        links = [0.0] * (stages - 1)
        links[link] = delay_ms
        slow = calm.with_links(links)
        ds = deepspeed_1f1b(stages, n)
        zb = zb_h1(calm, n)
        ours_calm = search(calm, n, budget_s=0.5).schedule
        ours_slow = search(slow, n, budget_s=1.0).schedule  # re-planned for the measured delay
        rows = [
            ("DeepSpeed 1F1B (stock)", replay(ds, calm, n, True), replay(ds, slow, n, True)),
            ("static ZB-H1", replay(zb, calm, n), replay(zb, slow, n)),
            ("PipeMorph (re-planned)", replay(ours_calm, calm, n), replay(ours_slow, slow, n)),
        ]
    t = Table(title=f"{stages} stages x {n} micro-batches, F=B=W={op_ms:g} ms, {delay_ms:g} ms on link {link} "
                    "(replay simulator)", title_justify="left")
    for col in ("schedule", "no delay ms", "slow link ms", "slowdown", "bubble rate"):
        t.add_column(col, justify="right")
    best = rows[-1][2].iteration_ms
    for name, a, b in rows:
        t.add_row(name, f"{a.iteration_ms:.0f}", f"{b.iteration_ms:.0f}", f"{b.iteration_ms / a.iteration_ms:.2f}x",
                  f"{b.bubble_rate:.1%}")
    console.print(t)
    console.print(f"PipeMorph is {rows[0][2].iteration_ms / best:.2f}x faster than stock 1F1B and "
                  f"{rows[1][2].iteration_ms / best:.2f}x faster than static ZB-H1 under the slow link.")
