"""The engine's hook points and the plug-in registry (``runtime.hooks``), without ranks.

An engine hook follows only the instructions it names (the others keep their very handler, so an
engine without hooks runs exactly its class's handlers); the ``inject`` section is validated by the
registered plug-in, and refused when none is registered; ``build_transport`` applies transport hooks.
"""
from __future__ import annotations

import time

import pytest

from ds_pipemorph.inject.section import InjectConfig
from ds_pipemorph.inject.plugin import PLUGIN
from ds_pipemorph.inject.wrapping import TransportWrapper
from ds_pipemorph.runtime import hooks
from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config, path_keys


class F: pass  # noqa: E701 - stand-ins for instruction types
class W: pass  # noqa: E701
class SEND: pass  # noqa: E701


def _handler(calls):
    def run(engine, micro_batch):
        calls.append(("ran", micro_batch, time.perf_counter()))
        return micro_batch * 10
    return run


class Record(hooks.EngineHooks):
    def __init__(self, name, ops, calls):
        self.name, self.ops, self.calls = name, frozenset(ops), calls

    def start_iteration(self, engine):
        self.calls.append((self.name, "start"))

    def after_op(self, engine, instruction, kwargs, started):
        self.calls.append((self.name, instruction.__name__, dict(kwargs), started))


def test_hooks_follow_only_the_instructions_they_name_in_the_order_they_were_added():
    calls = []
    handlers = {F: _handler(calls), W: _handler(calls), SEND: _handler(calls)}
    first, second = Record("first", [F, W], calls), Record("second", [F], calls)
    hooked = hooks.Hooks([first, second])
    composed = hooked.around(handlers)
    assert composed is not handlers and handlers[F].__name__ == "run"  # the map it was given is left as it was
    assert composed[SEND] is handlers[SEND]  # no hook asks for SEND: its very handler
    assert composed[F] is not handlers[F] and composed[F].__wrapped__ is handlers[F]
    assert composed[F]("engine", micro_batch=3) == 30  # the handler's result comes back
    ran = calls[0]
    assert ran[:2] == ("ran", 3)
    assert [c[:3] for c in calls[1:]] == [("first", "F", {"micro_batch": 3}), ("second", "F", {"micro_batch": 3})]
    assert calls[1][3] <= ran[2]  # ``started`` was taken before the handler ran
    calls.clear()
    composed[W]("engine", micro_batch=1)
    assert [c[:2] for c in calls] == [("ran", 1), ("first", "W")]
    calls.clear()
    hooked.start_iteration("engine")
    assert calls == [("first", "start"), ("second", "start")]


def test_hooks_merge_migration_drops_and_keep_the_first_reason_to_refuse_ready_dispatch():
    a, b = hooks.EngineHooks(), hooks.EngineHooks()
    a.migration_drop, b.migration_drop = frozenset({0}), frozenset({2})
    b.ready_refused = "inject.faults cannot be combined with dispatch 'ready'"
    merged = hooks.Hooks([a, b])
    assert merged.migration_drop == {0, 2} and merged.ready_refused == b.ready_refused
    assert hooks.Hooks([]).around({F: len}) == {F: len} and hooks.Hooks([a]).ready_refused is None


def test_the_inject_section_is_the_registered_plugins_and_its_paths_resolve_with_the_others():
    assert hooks.plugin("inject") is PLUGIN  # importing ds_pipemorph registered it
    cfg = parse_config({"inject": {"links": {"1": {"delay_ms": 5}}}})
    assert isinstance(cfg.inject, InjectConfig) and cfg.inject.links["1"].delay_ms == 5.0
    assert isinstance(parse_config({}).inject, InjectConfig)  # every key at its default
    assert ("inject", "trace") in path_keys() and ("inject", "compute_trace") in path_keys()
    assert [(p.key, type(s)) for p, s in hooks.active_plugins(cfg)] == [("inject", InjectConfig)]


def test_without_a_registered_plugin_an_inject_section_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setattr(hooks, "_PLUGINS", {})
    with pytest.raises(PipeMorphConfigError, match=r"^ds_config pipemorph: inject: no plug-in reads 'inject' in this "
                                                   r"process \(import ds_pipemorph first\)$"):
        parse_config({"inject": {"links": {"1": {"delay_ms": 5}}}})
    assert parse_config({}).inject is None
    assert hooks.active_plugins(parse_config({})) == [] and ("inject", "trace") not in path_keys()


def test_a_plugin_reads_a_section_the_config_keeps_for_plugins():
    class Stray(hooks.Plugin):
        key = "schedule"

    with pytest.raises(ValueError, match=r"a plug-in reads one of the sections \('inject',\), not 'schedule'"):
        hooks.register_plugin(Stray())


class Counting(TransportWrapper):
    """A direct-path wrapper that counts sends (none happen here: the test only checks where it sits)."""


class Marked(TransportWrapper):
    """A router wrapper."""


class Both(hooks.TransportHooks):
    def __init__(self):
        self.seen = []

    def wrap_direct(self, direct, *, rank, stage_id, timeout_s):
        self.seen.append((rank, stage_id, timeout_s))
        return Counting(direct)

    def wrap_router(self, router):
        return Marked(router)


def test_build_transport_puts_transport_hooks_around_the_direct_path_and_the_router():
    from ds_pipemorph.runtime.transport.router import LinkRouter, build_transport

    cfg = parse_config({"delegation": {"mode": "off"}, "timeout_s": 7})
    both = Both()
    tr = build_transport(cfg, 0, 0, [0, 1], None, hooks=[both], store_port=1)
    try:
        assert isinstance(tr, Marked) and isinstance(tr.inner, LinkRouter)
        assert isinstance(tr.inner.direct, Counting) and both.seen == [(0, 0, 7.0)]
        assert tr.inner.delegated.delays is None  # no hook gave a delay source
    finally:
        tr.close()
    plain = build_transport(cfg, 0, 0, [0, 1], None, store_port=1)  # the plug-in's hooks for this config: none
    try:
        assert isinstance(plain, LinkRouter) and type(plain.direct).__name__ == "DirectTransport"
    finally:
        plain.close()


def test_a_running_router_takes_transport_hooks_on_its_direct_path_and_both_paths_read_their_delays():
    from ds_pipemorph.inject.delays import DelayInjector, DelaySchedule
    from ds_pipemorph.inject.plugin import InjectTransport
    from ds_pipemorph.runtime.transport.router import build_transport

    cfg = parse_config({"delegation": {"mode": "off"}})
    router = build_transport(cfg, 0, 0, [0, 1], None, store_port=1)
    plain = router.direct
    delays = DelaySchedule([5.0])
    try:
        router.add_hooks(InjectTransport(delays), timeout_s=3.0)
        assert isinstance(router.direct, DelayInjector) and router.direct.inner is plain
        assert router.direct.timeout_s == 3.0 and router.direct.delays is delays
        assert router.delegated.delays is delays  # the delegates apply the same delays
        assert router.direct.on_failure == router._recover  # a failed delayed delivery fails over
    finally:
        router.close()


def test_under_ready_dispatch_hooks_follow_the_inboxs_receive_handlers_as_well():
    from ds_pipemorph.plan.ir.lower import LoweringPolicy
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sched.baselines import zb_h1
    from ds_pipemorph.runtime import instructions as I
    from ds_pipemorph.runtime.engine import PipeMorphEngine
    from ds_pipemorph.runtime.ready_exec import ReadyProgram
    from ds_pipemorph.runtime.schedule import PipeMorphSchedule

    plan = zb_h1(Costs.uniform(3), 4)
    stream = LoweringPolicy().for_dispatch("ready").lower(plan)[1]  # the middle stage receives both ways
    schedule = PipeMorphSchedule(stream, 4, 3, 1)
    watched = (I.PostRecvActivation, I.RecvActivation, I.RecvGrad, I.ForwardPass)
    hooked = hooks.Hooks([Record("r", watched, [])])
    program = ReadyProgram(schedule, hooked.around(PipeMorphEngine._INSTRUCTION_MAP), fused=False, hooks=hooked)
    entries = program.posts + [e for unit in program.units.values() for e in unit.entries]
    by_text = {text[:6]: handler for _, text, handler, _, _ in entries}
    # Each watched instruction runs a composed handler wrapping the one ready dispatch uses for it:
    # the inbox's for the receives, the engine's own for F.
    from ds_pipemorph.runtime import ready_exec

    for prefix, own in (("POST_F", ready_exec._post_f), ("RECV_F", ready_exec._take_f),
                        ("RECV_B", ready_exec._take_b), ("F0", PipeMorphEngine._INSTRUCTION_MAP[I.ForwardPass])):
        handler = next(h for t, h in by_text.items() if t.startswith(prefix))
        assert getattr(handler, "__wrapped__", None) is own, prefix
    plain = ReadyProgram(schedule, PipeMorphEngine._INSTRUCTION_MAP, fused=False)
    assert all(not hasattr(h, "__wrapped__") for _, _, h, _, _ in plain.posts)


def test_hooks_added_while_ready_dispatch_runs_are_refused_if_they_refuse_it_and_nothing_changes():
    from ds_pipemorph.runtime.engine import PipeMorphEngine
    from ds_pipemorph.runtime.transfer import Transfer

    engine = object.__new__(PipeMorphEngine)  # the method's own state only: no ranks, no DeepSpeed
    engine.hooks, engine._handlers, engine.inbox = None, PipeMorphEngine._INSTRUCTION_MAP, object()
    engine.transfer = Transfer()
    refusing = hooks.EngineHooks()
    refusing.ready_refused = "inject.faults cannot be combined with dispatch 'ready'"
    with pytest.raises(PipeMorphConfigError, match="cannot be combined"):
        engine.add_hooks(refusing)
    assert engine.hooks is None and engine._handlers is PipeMorphEngine._INSTRUCTION_MAP
    dropping = hooks.EngineHooks()
    dropping.migration_drop = frozenset({1})
    engine.add_hooks(dropping)  # a migration's transfer drops what hooks added later ask for too
    assert engine.transfer.drops(1) and not engine.transfer.drops(0)


def test_under_nccls_rules_only_injected_delays_outside_the_double_are_refused_in_one_sentence():
    """Delay lanes send from their own thread (out of the stream's order): refused on the NCCL backend;
    under the NCCL double the double holds the messages in the pair's queue instead, and failing
    links post their receives where the stream does."""
    from ds_pipemorph.inject.delays import DelaySchedule
    from ds_pipemorph.inject.faults import Faults
    from ds_pipemorph.inject.plugin import InjectTransport
    from ds_pipemorph.runtime.assembly import nccl_rules, out_of_order_refusal

    delays = DelaySchedule(static_ms=[5.0])
    lanes = InjectTransport(delays)
    assert nccl_rules("nccl", "auto", [lanes])
    refusal = out_of_order_refusal(True, [lanes])
    assert refusal.startswith("a transport hook issues the direct path's sends or receives out of the stream's order")
    assert refusal.endswith('set pipemorph.delegation.mode to "always"') and refusal.count(". ") == 0
    assert out_of_order_refusal(False, [lanes]) is None  # gloo matches by tag: any order is fine
    assert out_of_order_refusal(True, [InjectTransport(delays, nccl_rules=True)]) is None
    assert out_of_order_refusal(True, [InjectTransport(faults=Faults(link_fails_after={0: 3}))]) is None
