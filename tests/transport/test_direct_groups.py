"""The direct path's groups (``DirectTransport.begin_group``/``end_group``), on a recording
point-to-point layer: what one ``batch`` holds, one work for a whole group (NCCL's coalesced batch)
shared by its operations, a header wait inside a group, and a group that cannot be issued."""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.runtime.transport.direct import DirectTransport
from ds_pipemorph.runtime.transport.header import encode_header, untag
from ds_pipemorph.runtime.transport.protocol import TransportError


class _Work:
    def __init__(self, log: list, name: str):
        self.log, self.name, self.done = log, name, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        self.log.append(f"wait {self.name}")
        self.done = True
        return True


class InOrder:
    """A point-to-point layer with NCCL's ``in_order``; ``batch`` coalesces (one work) unless told not to."""

    in_order = True

    def __init__(self, coalesce: bool = True, fail: bool = False, header: torch.Tensor | None = None):
        self.coalesce, self.fail, self.header = coalesce, fail, header
        self.log: list[str] = []

    def isend(self, t, dst, tag):
        self.log.append(f"send {untag(tag)}")
        return _Work(self.log, untag(tag))

    def irecv(self, t, src, tag):
        self.log.append(f"recv {untag(tag)}")
        if tag % 64 == 0 and self.header is not None:
            t.copy_(self.header)
        return _Work(self.log, untag(tag))

    def batch(self, ops):
        if self.fail:
            raise RuntimeError("ncclInvalidUsage: something broke\nmore lines")
        names = [("send " if s else "recv ") + untag(tag) for s, _, _, tag in ops]
        self.log.append("batch [" + ", ".join(names) + "]")
        for s, t, _, tag in ops:
            if not s and tag % 64 == 0 and self.header is not None:
                t.copy_(self.header)
        if self.coalesce:
            return [_Work(self.log, "batch of " + str(len(ops)))]
        return [_Work(self.log, n) for n in names]

    def close(self):
        pass


def _stage1(p2p) -> DirectTransport:
    return DirectTransport(1, 1, [0, 1, 2], timeout_s=5.0, p2p=p2p)  # F comes from rank 0, B goes back to it


def test_a_group_goes_out_as_one_batch_and_every_op_waits_for_its_one_work():
    x = torch.ones(3)
    p2p = InOrder(header=encode_header([x], True))
    t = _stage1(p2p)
    for mb in (0, 1):  # the first messages carry their layouts: no header inside the group below
        t.send("B", mb, x)
        t.post_recv("F", mb)
        t.recv("F", mb)
    t.wait_sends()
    p2p.log.clear()
    t.begin_group()
    t.post_recv("F", 1)
    t.send("B", 1, x)
    assert p2p.log == []  # nothing issued before the group ends
    t.end_group()
    assert p2p.log == ["batch [recv F1 part 1, send B1 part 1]"]
    t.recv("F", 1)
    t.wait_sends()
    assert p2p.log[1:] == ["wait batch of 2", "wait batch of 2"]  # the receive, then the send: one work


def test_a_header_wait_inside_a_group_issues_what_was_collected_first():
    x = torch.ones(2, 2)
    p2p = InOrder(coalesce=False, header=encode_header([x], True))
    t = _stage1(p2p)
    t.begin_group()
    t.send("B", 0, x)  # first message: header and tensor
    t.post_recv("F", 1)  # layout unknown: its header must be in before its tensor is posted
    t.end_group()
    assert p2p.log == ["batch [send B0 header, send B0 part 1, recv F1 header]", "wait recv F1 header",
                       "batch [recv F1 part 1]"]


def test_a_group_that_cannot_be_issued_fails_each_of_its_ops_with_one_sentence():
    x = torch.ones(3)
    t = _stage1(InOrder(fail=True))
    t.begin_group()
    t.send("B", 0, x)
    with pytest.raises(TransportError) as e:
        t.end_group()
    assert str(e.value) == ("rank 1: a group of 2 sends and receives with rank(s) [0] failed: "
                            "ncclInvalidUsage: something broke")
    with pytest.raises(TransportError, match="a group of 2 sends and receives"):
        t.wait_sends()  # the group's sends carry its error, not a missing work
    t.send("B", 1, x)  # the failed group is closed: this send goes out at once
    assert "send B1 part 1" in t.p2p.log
