"""A/B inside the user's own training job: does PipeMorph pay on this model, on this cluster?

With ``"compare": {"schedule": "1f1b"}`` in the ``pipemorph`` section, the engine alternates two
settings at iteration boundaries: **B** is the job's own schedule and dispatch (the plan the control
loop keeps current), **A** the ``compare`` section's (``1f1b``: DeepSpeed's own order, run by this
engine, as stock trains; with ``"backward": "fused"`` also stock's one backward pass). Every
iteration still trains: ours is exact in any order, so A and B
iterations give the same model a stock job would. The cycle is ``A B A' B`` (``ds_pipemorph.paired``):
each B is paired with the A-side iteration before it, each A' with the A two before it (the noise
check), and what slows the machine for a while slows both members of a pair.

An iteration's time is rank 0's ``train_batch``, from its call to its return (the first stage's
start to its last weight gradient and the step). The first ``warmup`` iterations alternate but are
not measured. After ``iterations`` measured ones (or when the engine is destroyed, at the end of
training) rank 0 logs one line: B/A per pair with its 95 % interval, the A'/A check and the
verdict; the job then runs B only. ``engine.comparison()`` returns the result over what is measured
so far, on any rank, and changes nothing. While the comparison runs, the engine chooses each
iteration's plan: a ``switch_to`` between iterations is overridden by the next iteration's side.

The control loop keeps measuring in A's iterations too (op and link times do not depend on the
order); a re-plan it makes takes B's place, whichever side ran.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

from ..paired import A_SIDE, CYCLE, Comparison, compare
from ..plan.ir.lower import Dispatch
from ..plan.ir.ops import Schedule
from .config import PipeMorphConfig, PipeMorphConfigError
from .plans import NCCL_READY_REFUSED, build_plan

logger = logging.getLogger(__name__)


class Compare:
    """Decides each iteration's side, switches the engine to it, and times the iteration."""

    def __init__(self, engine, cfg: PipeMorphConfig):
        c = cfg.compare
        if c.dispatch is Dispatch.READY and engine.nccl_rules:  # refused at start-up, not at the first A iteration
            raise PipeMorphConfigError(NCCL_READY_REFUSED)
        self.cfg = c
        self._a_cfg = cfg.model_copy(update={"schedule": c.schedule})
        self.a_plan = build_plan(self._a_cfg, engine.num_stages, engine.micro_batches, engine.w_share, engine.budget)
        self.a_dispatch = c.dispatch
        self.b_dispatch = engine.dispatch
        self.b_plan = engine.plan
        self.b_lowering = engine.lowering
        fused = self.b_lowering.fused if c.backward is None else c.backward == "fused"
        self.a_lowering = replace(self.b_lowering, fused=fused)
        self.a_label = f"{c.schedule}/{c.dispatch}" + ("" if fused == self.b_lowering.fused else
                                                       f"/{'fused' if fused else 'split'}")
        self.b_label = f"{cfg.schedule}/{engine.dispatch}"
        self.total = None if c.iterations is None else c.warmup + c.iterations
        self.sides: list[str] = []
        self.times: list[float] = []
        self.result: Optional[Comparison] = None
        self.done = False
        self._a_installed = None
        self._t0 = 0.0

    def plan_within(self, engine, budget) -> Schedule:
        """Side A's plan within ``budget`` (a memory grant about to come into force), changing nothing;
        a plan the grant cannot hold is refused naming this setting."""
        try:
            return build_plan(self._a_cfg, engine.num_stages, engine.micro_batches, engine.w_share, budget)
        except PipeMorphConfigError as e:
            raise PipeMorphConfigError(f"pipemorph.compare.schedule: {e}") from None

    def rebudget(self, engine, a_plan: Schedule) -> None:
        """A memory grant came into force (``PipeMorphEngine``): both sides are the plans made within it
        (``a_plan`` from ``plan_within``)."""
        self.a_plan = a_plan
        self.b_plan = engine.plan

    def before(self, engine) -> None:
        """Switch to the side of the next iteration (every rank alike: it depends on the count only)."""
        if self.done:
            return
        side = CYCLE[(len(self.sides) - self.cfg.warmup) % len(CYCLE)]  # as paired.sequence lays them out
        if side in A_SIDE:
            engine.switch_to(self.a_plan, self.a_dispatch, self.a_lowering)
            self._a_installed = engine.plan
        else:
            engine.switch_to(self.b_plan, self.b_dispatch, self.b_lowering)
        self.sides.append(side)
        self._t0 = time.perf_counter()

    def abandon(self) -> None:
        """The iteration that ``before`` started failed: forget its side."""
        if not self.done and len(self.sides) > len(self.times):
            self.sides.pop()

    def current(self) -> Optional[Comparison]:
        """The result over what is measured so far (the final one once the comparison ended)."""
        if self.done:
            return self.result
        try:
            return compare(self.sides[:len(self.times)], self.times, self.cfg.warmup)
        except ValueError:  # no pair measured yet
            return None

    def after(self, engine) -> None:
        """Time the iteration; a plan the control loop adopted during it is B's from now on."""
        if self.done:
            return
        self.times.append((time.perf_counter() - self._t0) * 1e3)
        if self.sides[-1] == "B" or engine.plan is not self._a_installed:
            self.b_plan = engine.plan
        if self.sides[-1] == "B":  # (a lowering switched to during B stays B's)
            self.b_lowering = engine.lowering
        if self.total is not None and len(self.times) >= self.total:
            self.finish(engine)

    def finish(self, engine) -> Optional[Comparison]:
        """End the comparison: back to B, and rank 0 logs the result (once)."""
        if self.done:
            return self.result
        self.result = self.current()  # None: training ended within the warm-up
        self.done = True
        if not getattr(engine, "_destroyed", False):
            engine.switch_to(self.b_plan, self.b_dispatch, self.b_lowering)
        measured = len(self.times) - self.cfg.warmup
        if engine.global_rank == 0:
            logger.warning(self.describe(measured))
        return self.result

    def describe(self, measured: int) -> str:
        head = f"pipemorph compare: B = {self.b_label}, A = {self.a_label}"
        if self.result is None:
            return (f"{head}: nothing measured ({len(self.times)} iterations, {self.cfg.warmup} of warm-up); "
                    f"train longer or lower compare.warmup")
        r = self.result
        return (f"{head}, {measured} measured iterations: {r.verdict} (median {r.b_median_ms:.1f} ms "
                f"against {r.a_median_ms:.1f} ms per iteration)")
