"""The injection plug-in: how ``pipemorph.inject`` reaches the runtime's hooks (``runtime.hooks``).

``ds_pipemorph.inject`` registers ``PLUGIN`` when it is imported (``ds_pipemorph/__init__`` imports
it). The runtime then validates the ``inject`` section with ``InjectConfig`` (``inject.section``), asks
``check``/``check_job`` to refuse what a job cannot use, and builds per rank:

- ``InjectTransport`` (a ``TransportHooks``): the direct path under NCCL's point-to-point rules
  (``nccl_double.NcclRules``, which it then announces as ``p2p_rules = "nccl"``), under
  ``faults.FaultyLink`` (links that break after K messages) under ``delays.DelayInjector`` (slow
  links; under the NCCL double the double holds a slow link's messages instead), the delay
  schedule handed to the delegated path (its sender delegates apply it), and
  ``faults.DelegateKiller`` around the router;
- engine hooks: ``compute.ComputeInjector`` (slowed stages, after each F, B and W),
  ``rank_links.SlowAllReduce`` (a slow data-parallel ring, after ``ReduceGrads``) and
  ``Settings`` (migration attempts that lose their payload; why ready dispatch is refused).

Everything torch needs is imported when a job asks for it, not here: importing ``ds_pipemorph``
stays light.
"""
from __future__ import annotations

from typing import Optional

from ..fileio import BadInput
from ..plan.ir.lower import Dispatch
from ..runtime.config import PipeMorphConfigError
from ..runtime.hooks import EngineHooks, Plugin, TransportHooks
from .section import InjectConfig

READY_REFUSED = "inject.faults cannot be combined with dispatch 'ready'"


class InjectTransport(TransportHooks):
    """Delays (``delays.DelaySchedule``), faults (``faults.Faults``) and NCCL's rules (``nccl_rules``)
    on one rank's link router."""

    def __init__(self, delays=None, faults=None, nccl_rules: bool = False):
        self.delays, self.faults = delays, faults
        self.p2p_rules = "nccl" if nccl_rules else None
        # A delay lane sends from its own thread, later than the stream puts the send; under the NCCL
        # double the delays are applied in the pair's queue instead, in issue order.
        self.keeps_issue_order = delays is None or nccl_rules

    def wrap_direct(self, direct, *, rank: int, stage_id: int, timeout_s: float):
        if self.p2p_rules == "nccl":  # the wire itself: NCCL's queues under everything else
            from .nccl_double import NcclRules

            direct = direct.with_p2p(NcclRules(rank, timeout_s, self._pair_delay_s(direct.stage_ranks, stage_id)))
        if self.faults is not None:  # next to the wire: on a delayed link a send fails after its delay
            from .faults import FaultyLink

            direct = FaultyLink(direct, rank, stage_id, self.faults)
        if self.delays is not None and self.p2p_rules != "nccl":
            from .delays import DelayInjector

            direct = DelayInjector(direct, stage_id, self.delays, timeout_s=timeout_s)
        return direct

    def _pair_delay_s(self, stage_ranks, stage_id: int):
        """Seconds a message to a peer rank is held in the NCCL double: the delay of the link between them."""
        if self.delays is None:
            return None
        delays, stage_of = self.delays, {r: s for s, r in enumerate(stage_ranks)}
        return lambda peer: delays.delay_ms(min(stage_id, stage_of[peer])) / 1000.0

    def wrap_router(self, router):
        if self.faults is None or self.faults.kill_delegate is None:
            return router
        from .faults import DelegateKiller

        return DelegateKiller(router, self.faults)


class Settings(EngineHooks):
    """What the section asks of the engine beyond its ops: migration attempts whose payload is never
    sent, and the sentence that refuses ready dispatch while links may fail."""

    def __init__(self, migration_drop=(), ready_refused: Optional[str] = None):
        self.migration_drop = frozenset(migration_drop)
        self.ready_refused = ready_refused


class InjectPlugin(Plugin):
    key = "inject"
    model = InjectConfig
    path_keys = (("trace",), ("compute_trace",))
    descriptions = {
        "inject": "testing only: slow links, faults and compute stragglers made on purpose; the control loop never "
                  "reads these settings",
        "inject.links": "testing only: link index → delay, e.g. `{\"2\": {\"delay_ms\": 30}}`",
        "inject.links.*.delay_ms": "testing only: extra one-way latency of every message on the link, in ms",
        "inject.trace": "testing only: a delay trace file `points: [{t: 0.0, links_ms: [...]}, ...]` replayed in "
                        "wall-clock time (`recipes/stragglers/make_trace.py`)",
        "inject.faults": "testing only: link failures and killed delegates (failover, PipeMorph §5.3)",
        "inject.faults.link_fails_after": "testing only: link index → K; each direction of the link's direct path "
                                          "carries K messages, then fails",
        "inject.faults.kill_delegate": "testing only: kill one delegate process mid-run (needs "
                                       "`delegation.mode: always`)",
        "inject.faults.kill_delegate.link": "testing only: the link whose delegate is killed",
        "inject.faults.kill_delegate.after": "testing only: activation messages on the link before the kill",
        "inject.faults.kill_delegate.side": "testing only: which end's delegate is killed",
        "inject.compute": "testing only: stage index → factor ≥ 1, e.g. `{\"2\": 2.0}`: each F, B and W of the "
                          "stage waits (factor − 1) × its own measured time after it ran; numbers are unchanged",
        "inject.compute_trace": "testing only: a file `points: [{iteration: 3, factors: {\"2\": 2.0}}, ...]`; from "
                                "`train_batch` k on (0 = the first) the point's factors hold (unnamed stages: 1); not "
                                "together with `inject.compute`",
        "inject.rank_links": "testing only: `{\"0-4\": 30}` slows the link between global ranks 0 and 4 by 30 ms "
                             "one way: a pipeline link between them per message, an all-reduce ring through it "
                             "2(D − 1) × `allreduce_messages` times per all-reduce",
        "inject.allreduce_messages": "testing only: messages each part of a ring all-reduce travels as; each pays a "
                                     "slow ring link's delay once",
        "inject.nccl_rules": "testing only: the direct path runs under NCCL's point-to-point rules on gloo (one "
                             "serial queue per pair of ranks, tags ignored, a send completes with its receive; "
                             "docs/nccl.md), and the engine lowers for NCCL as it does on the NCCL backend",
        "inject.migration_drop": "testing only: migration attempts (0 = the first) whose layer state is never sent, "
                                 "only its size, as a connection lost mid-transfer would leave it",
    }

    def check(self, settings: InjectConfig, cfg) -> None:
        faults = settings.faults
        if faults is not None and faults.kill_delegate is not None and cfg.delegation.mode != "always":
            raise ValueError("inject.faults.kill_delegate needs delegation.mode 'always' (the delegate it kills "
                             "must exist at that message)")
        if faults is not None and cfg.dispatch is Dispatch.READY:
            raise ValueError("inject.faults cannot be combined with dispatch 'ready': its receives all wait from "
                             "the start of the iteration, so a link failing over mid-iteration is not followed yet")

    def check_job(self, settings: InjectConfig, stages: int) -> None:
        from .compute import compute_schedule
        from .faults import faults_from_config

        self._delays(settings, stages)
        compute_schedule(settings, stages)
        faults_from_config(settings.faults, stages)

    @staticmethod
    def _delays(settings: InjectConfig, stages: int):
        from .delays import delay_schedule

        try:
            return delay_schedule(settings, stages)
        except BadInput as e:
            raise PipeMorphConfigError(str(e)) from None

    def transport_hooks(self, settings: InjectConfig, stages: int, engine=None) -> Optional[InjectTransport]:
        """``engine`` (when the engine builds its router): slow rank pairs that are neighbouring stages
        of its pipeline slow that link too (``rank_links``)."""
        from .faults import faults_from_config

        delays = self._delays(settings, stages)
        if engine is not None and settings.rank_links:
            from .rank_links import add_pipeline_delays

            delays = add_pipeline_delays(settings, engine, delays)
        faults = faults_from_config(settings.faults, stages)
        if delays is None and faults is None and not settings.nccl_rules:
            return None
        return InjectTransport(delays, faults, settings.nccl_rules)

    def engine_hooks(self, settings: InjectConfig, engine) -> list[EngineHooks]:
        out: list[EngineHooks] = []
        if settings.compute or settings.compute_trace:  # a slowed stage
            from .compute import ComputeInjector, compute_schedule

            slowdown = compute_schedule(settings, engine.num_stages)
            if slowdown is not None and slowdown.touches(engine.stage_id):
                sync = None
                if engine.device.type != "cpu":
                    from deepspeed.accelerator import get_accelerator

                    sync = get_accelerator().synchronize
                out.append(ComputeInjector(slowdown, engine.stage_id, sync))
        if settings.rank_links:  # slow links between given ranks: the all-reduce ring they slow
            from .rank_links import slow_allreduce

            hook = slow_allreduce(settings, engine)
            if hook is not None:
                out.append(hook)
        if settings.migration_drop or settings.faults is not None:
            out.append(Settings(settings.migration_drop, READY_REFUSED if settings.faults is not None else None))
        return out


PLUGIN = InjectPlugin()
