"""Every transport and every wrapper keeps the one ``Transport`` protocol (and the router and its wrapper
``LinkControl``) by its own methods, with the protocol's signatures; ``link_of`` agrees with the link
rule written out per stage of a 4-stage pipeline. No ranks: objects are built but never send."""
from __future__ import annotations

import inspect

import pytest

from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport
from ds_pipemorph.runtime.transport.direct import DirectTransport
from ds_pipemorph.runtime.transport.protocol import (
    DeferredSends,
    LinkControl,
    Transport,
    TransportError,
    directions_on,
    link_of,
    peer_of,
)
from ds_pipemorph.runtime.transport.router import LinkRouter
from ds_pipemorph.inject.faults import DelegateKiller, FaultyLink, Faults
from ds_pipemorph.inject.delays import DelayInjector, DelaySchedule
from ds_pipemorph.inject.wrapping import RouterWrapper, TransportWrapper

TRANSPORT_METHODS = ("post_recv", "send", "recv", "wait_sends", "begin_group", "end_group", "reset_shapes", "close")
CONTROL_METHODS = ("link_mode", "set_link_mode", "queues_of", "delegate_pid", "prewarm")
TRANSPORTS = (DirectTransport, DelegatedTransport, LinkRouter, DelayInjector, FaultyLink, DelegateKiller,
              TransportWrapper, RouterWrapper)
CONTROLS = (LinkRouter, DelegateKiller, RouterWrapper)


def _shape(fn) -> list[tuple[str, object, object]]:
    """Parameter names, kinds and defaults (annotations aside), without ``self``."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("cls", TRANSPORTS, ids=lambda c: c.__name__)
def test_every_transport_and_wrapper_defines_the_transport_methods_with_the_protocols_signatures(cls):
    assert not any("__getattr__" in vars(k) for k in cls.__mro__), f"{cls.__name__} forwards by __getattr__"
    for name in TRANSPORT_METHODS:
        assert _shape(getattr(cls, name)) == _shape(getattr(Transport, name)), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", CONTROLS, ids=lambda c: c.__name__)
def test_the_router_and_its_wrappers_define_the_link_control_methods_with_the_protocols_signatures(cls):
    for name in CONTROL_METHODS:
        assert _shape(getattr(cls, name)) == _shape(getattr(LinkControl, name)), f"{cls.__name__}.{name}"


def test_instances_pass_isinstance_against_the_runtime_checkable_protocols():
    direct = DirectTransport(0, 0, [0, 1], timeout_s=1.0)
    delegated = DelegatedTransport(0, 0, [0, 1], timeout_s=1.0, queues=1, store_port=1)
    delayed = DelayInjector(direct, 0, DelaySchedule([0.0]))
    faulty = FaultyLink(direct, 0, 0, Faults(link_fails_after={0: 1}))
    router = LinkRouter(0, 0, delayed, delegated, {})
    killer = DelegateKiller(router, Faults(kill_delegate=(0, 1)))
    try:
        for t in (direct, delegated, delayed, faulty, router, killer):
            assert isinstance(t, Transport), type(t).__name__
        for t in (router, killer):
            assert isinstance(t, LinkControl), type(t).__name__
        assert not isinstance(direct, LinkControl)
        # Only the delay injector delivers later, from its own thread; the router hooks its failover there.
        assert isinstance(delayed, DeferredSends) and delayed.on_failure == router._recover
        assert not any(isinstance(t, DeferredSends) for t in (direct, delegated, faulty, router, killer))
        assert killer.events is router.events and killer.delegated is delegated and killer.direct is delayed
        assert killer.queues_of(0) == 1 and killer.link_mode(0, "B") == "direct"
    finally:
        killer.close()


# Written out from the pipeline, not from the code: link i joins stage i and stage i+1; activations F go
# from stage s to s+1, input gradients B from s+1 back to s. Per stage of 4: (kind, sending) -> link.
EXPECTED = {
    0: {("F", True): 0, ("B", False): 0},
    1: {("F", False): 0, ("B", True): 0, ("F", True): 1, ("B", False): 1},
    2: {("F", False): 1, ("B", True): 1, ("F", True): 2, ("B", False): 2},
    3: {("F", False): 2, ("B", True): 2},
}


@pytest.mark.parametrize("stage", sorted(EXPECTED))
def test_link_of_follows_the_direction_of_activations_and_gradients(stage):
    for (kind, sending), link in EXPECTED[stage].items():
        assert link_of(stage, kind, sending) == link, (stage, kind, sending)
        peer = peer_of(stage, kind, sending)
        assert {stage, peer} == {link, link + 1}  # the link joins this stage and its peer
        assert link_of(peer, kind, not sending) == link  # the other end names the same link
    for link in range(3):
        assert set(directions_on(stage, link)) == {d for d, l in EXPECTED[stage].items() if l == link}


def test_the_end_stages_have_no_link_beyond_the_pipeline_and_kinds_are_checked():
    assert link_of(0, "F", False) == -1 and link_of(0, "B", True) == -1  # stage 0 has no predecessor
    assert link_of(3, "F", True) == 3 and link_of(3, "B", False) == 3  # a 4-stage pipeline has links 0..2
    assert directions_on(0, -1) == (("F", False), ("B", True)) and directions_on(1, 3) == ()
    with pytest.raises(ValueError, match="message kind must be one of"):
        link_of(1, "W", True)


class _Wire:
    """A direct path that records what reaches it, in order."""

    def __init__(self):
        self.calls: list[str] = []

    def post_recv(self, kind, mb):
        self.calls.append(f"post {kind}{mb}")

    def recv(self, kind, mb):
        self.calls.append(f"recv {kind}{mb}")
        return kind, mb

    def send(self, kind, mb, payload):
        self.calls.append(f"send {kind}{mb}")


def test_a_failing_link_posts_its_first_k_receives_where_the_stream_does_and_none_after():
    wire = _Wire()
    faulty = FaultyLink(wire, rank=1, stage_id=1, faults=Faults(link_fails_after={0: 2}))  # stage 1 gets F on link 0
    for mb in range(3):
        faulty.post_recv("F", mb)
        faulty.post_recv("F", mb)  # numbered once; passed on to the (idempotent) direct path
    faulty.post_recv("B", 0)  # link 1 does not fail
    assert wire.calls == ["post F0", "post F0", "post F1", "post F1", "post B0"]
    assert faulty.recv("F", 0) == ("F", 0) and faulty.recv("F", 1) == ("F", 1)
    with pytest.raises(TransportError, match=r"rank 1: RECV_F2 on link 0 failed: injected fault \(link 0 fails after 2"):
        faulty.recv("F", 2)
    assert wire.calls[-2:] == ["recv F0", "recv F1"]  # the third never reached the wire
    with pytest.raises(TransportError, match="RECV_F3"):
        faulty.recv("F", 3)  # not posted ahead: counted at its receive, failing all the same
    assert faulty.count[(0, "F")] == 4 and wire.calls.count("post F3") == 0
    # A receive keeps the number it was posted with, whatever order the receives come in.
    wire = _Wire()
    faulty = FaultyLink(wire, rank=1, stage_id=1, faults=Faults(link_fails_after={0: 1}))
    faulty.post_recv("F", 0)
    faulty.post_recv("F", 1)
    with pytest.raises(TransportError, match="RECV_F1"):
        faulty.recv("F", 1)
    assert faulty.recv("F", 0) == ("F", 0) and wire.calls == ["post F0", "recv F0"]
