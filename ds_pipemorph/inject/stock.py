"""The same injected slow link for stock DeepSpeed (testing and benchmarks only).

Stock ``PipelineEngine`` sends through ``deepspeed.runtime.pipe.p2p.send`` (a blocking
``dist.send``). ``install`` replaces that function: a send on a delayed link waits until the
link's previous message was delivered (one message in flight, head-of-line blocking as in
``delays.Lane``) and then hands a copy to the link's lane, which performs the real send c ms
later. Messages of one link keep their order; links stay independent.
"""
from __future__ import annotations

from ..plan.ir.ops import Kind
from ..runtime.transport.protocol import link_of
from .delays import DelaySchedule, Lane


def install(delays: DelaySchedule, timeout_s: float = 300.0) -> dict:
    """Patch ``p2p.send`` of this process; returns the per-link seconds the sender spent blocked
    (``blocked_s``), ``drain()`` (wait for messages in flight) and ``uninstall()``."""
    from deepspeed.runtime.pipe import p2p

    original = p2p.send
    lanes: dict[int, Lane] = {}
    blocked: dict[int, float] = {}

    def send(tensor, dest_stage, async_op=False):
        src = p2p._grid.get_stage_id()
        link = link_of(src, Kind.F if dest_stage > src else Kind.B, sending=True)
        c = delays.delay_ms(link)
        if c <= 0 and link not in lanes:
            return original(tensor, dest_stage, async_op)
        lane = lanes.get(link)
        if lane is None:
            lane = lanes[link] = Lane(f"stock stage {src} link {link}")
        blocked[link] = blocked.get(link, 0.0) + lane.wait_free(timeout_s)
        copy = tensor.detach().clone()
        lane.submit(c / 1000.0, lambda: original(copy, dest_stage, async_op))

    def drain() -> None:
        for lane in lanes.values():
            lane.wait_free(timeout_s)

    def uninstall() -> None:
        for lane in lanes.values():
            lane.close()
        p2p.send = original

    p2p.send = send
    return {"blocked_s": blocked, "drain": drain, "uninstall": uninstall}
