"""A delayed send that fails in the delivery thread is a TransportError and is failed over like a
direct send failure: the undelivered message and every later one of that direction go through the
delegated path, in order, once. In-process fakes stand for the wire; no ranks."""
import threading
import time

import pytest

from ds_pipemorph.runtime.transport.protocol import DeliveryError, TransportError
from ds_pipemorph.runtime.transport.router import LinkRouter
from ds_pipemorph.inject.delays import DelayInjector, DelaySchedule

DELAY_MS = 5.0


class Wire:
    """A direct path whose send of the micro-batches in ``broken`` fails (``error`` is raised)."""

    def __init__(self, broken=(), error=TransportError):
        self.broken, self.error = set(broken), error
        self.sent, self.threads = [], []

    def send(self, kind, mb, payload):
        self.threads.append(threading.current_thread().name)
        if mb in self.broken:
            raise self.error(f"rank 0: SEND_{kind}{mb} on link 0 failed: connection closed")
        self.sent.append((kind, mb, payload))

    def wait_sends(self):
        pass

    def close(self):
        pass


class Delegates(Wire):
    """The delegated path: records what it carried; ``start_link`` is a no-op."""

    def start_link(self, link):
        pass


def _injector(wire, on_failure=None):
    return DelayInjector(wire, 0, DelaySchedule([DELAY_MS]), timeout_s=10.0, on_failure=on_failure)


@pytest.mark.timeout(30)
def test_failure_in_the_delivery_thread_is_raised_at_the_next_send_as_transport_error_with_the_message():
    inj = _injector(Wire(broken={1}))
    try:
        inj.send("F", 0, "a")
        inj.send("F", 1, "b")
        with pytest.raises(DeliveryError, match=r"SEND_F1 on link 0 failed: connection closed \(in the delivery "
                                                r"thread, after its injected delay\)") as e:
            inj.send("F", 2, "c")
        assert isinstance(e.value, TransportError)
        assert e.value.message == ("F", 1, "b") and not e.value.recovered
        assert [m for _, m, _ in inj.inner.sent] == [0]
        assert all(t.startswith("pipemorph-lane-") for t in inj.inner.threads)
    finally:
        inj.close()


@pytest.mark.timeout(30)
def test_failure_surfaces_at_wait_sends_and_any_error_becomes_a_transport_error():
    inj = _injector(Wire(broken={0}, error=OSError))
    try:
        inj.send("F", 0, "a")
        with pytest.raises(DeliveryError, match=r"stage 0: SEND_F0 failed: .*connection closed") as e:
            inj.wait_sends()
        assert e.value.message == ("F", 0, "a")
        inj.wait_sends()  # raised once
    finally:
        inj.close()


@pytest.mark.timeout(30)
def test_on_failure_runs_in_the_delivery_thread_before_the_training_thread_sees_the_error():
    seen = []
    inj = _injector(Wire(broken={0}), on_failure=lambda err: seen.append((err.message, threading.current_thread().name)))
    try:
        inj.send("F", 0, "a")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert seen and seen[0][0] == ("F", 0, "a") and seen[0][1].startswith("pipemorph-lane-")
        with pytest.raises(DeliveryError):
            inj.send("F", 1, "b")
    finally:
        inj.close()


def _router(broken):
    wire, deleg = Wire(broken=broken), Delegates()
    return LinkRouter(0, 0, _injector(wire), deleg, {}), wire, deleg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last", [False, True], ids=["failed-mid-stream", "failed-last-message"])
def test_router_fails_the_direction_over_and_delegates_the_undelivered_message_first(last):
    router, wire, deleg = _router(broken={3, 4, 5})
    n = 4 if last else 6
    try:
        for m in range(n):
            router.send("F", m, f"p{m}")
        router.wait_sends()
        assert [m for _, m, _ in wire.sent] == [0, 1, 2]
        assert [(m, p) for _, m, p in deleg.sent] == [(m, f"p{m}") for m in range(3, n)]
        # The re-send of F3 ran in the delivery thread (so a peer blocked on it is not stuck).
        assert deleg.threads[0].startswith("pipemorph-lane-")
        assert router.link_mode(0, "F") == "delegated" and router.link_mode(0, "B") == "direct"
        assert len(router.events) == 1 and "link 0 direct path failed at SEND_F3" in router.events[0]
        assert "in the delivery thread" in router.events[0]
        router.set_link_mode(0, "direct")  # a failed direction stays delegated
        assert router.link_mode(0, "F") == "delegated" and router.link_mode(0, "B") == "direct"
    finally:
        router.close()


@pytest.mark.timeout(30)
def test_a_re_send_that_failed_in_the_delivery_thread_is_retried_first_at_the_next_call():
    wire, deleg = Wire(broken={0}), Delegates(broken={0})
    router = LinkRouter(0, 0, _injector(wire), deleg, {})
    try:
        router.send("F", 0, "a")  # its delivery fails, and so does the re-send from the delivery thread
        deadline = time.monotonic() + 5
        while not deleg.threads and time.monotonic() < deadline:
            time.sleep(0.001)
        deleg.broken.clear()  # the delegated path works again
        router.send("F", 1, "b")
        router.wait_sends()
        assert [m for _, m, _ in deleg.sent] == [0, 1] and len(router.events) == 1
    finally:
        router.close()


@pytest.mark.timeout(30)
def test_without_failover_the_delivery_error_reaches_the_caller():
    wire, deleg = Wire(broken={0}), Delegates()
    router = LinkRouter(0, 0, _injector(wire), deleg, {}, failover=False)
    try:
        router.send("F", 0, "a")
        with pytest.raises(DeliveryError, match="SEND_F0 on link 0 failed"):
            router.wait_sends()
        assert deleg.sent == [] and router.events == []
    finally:
        router.close()
