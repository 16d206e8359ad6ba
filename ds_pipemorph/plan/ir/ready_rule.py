"""One stage's readiness-driven dispatch rule (RRFP), as the engine applies it while it runs.

The stage's order in the plan is a hint. Whenever the stage is idle it starts, among the ops it
has not run, the first one in the hint that is ready now:

- ``F m``: its activation has arrived (the first stage: always), fewer than ``cap``
  activations are held (F done, B not done) and, with a memory budget ``units``
  (``plan.ir.memory``), one more fits: held activations plus ``w_share`` for each micro-batch
  between its B and its W stay within ``units``;
- ``B m``: ``F m`` is done and its output gradient has arrived (the last stage: none needed);
- ``W m``: ``B m`` is done and every W before it in the hint has run: weight gradients are
  accumulated in the hint's order whatever the order of the backwards, so a stage adds its
  micro-batches' gradients in the same order as under ordered dispatch (bf16/fp16 training then
  gives the same bits under both dispatches). A W fused with its B (``fused_backward``) runs
  with it when it is that W's turn (``w_in_turn``, asked once the B started); otherwise the two
  run split, the gradient leaving after the B and the W at its turn. When the memory budget holds
  a forward back and the next W in the hint's order waits for its B, the W of the earliest
  backward already run is ready too
  (the memory frees; the order of accumulation then differs from the hint's); when a B would exceed
  the budget (``w_share`` above 1: B leaves more for W than F left for B), that W runs first.

Patience (``hold``): a ready op does not jump ahead of the hint's first op when that op waits
only for its message and the message is expected before the jumping op would end; the stage waits
for the message instead, at most until it is due plus a tenth of the op. The engine expects a
message when it came in the last iteration; the replay knows when a message in flight lands.

The engine (``runtime.ready_exec``) and the replay (``plan.sim.ready``) both run this class, so the
replay predicts the engine's choices; ``docs/ready_dispatch.md`` argues why the rule cannot
deadlock when every cap is at least 1 (a hold waits for a message already on its way, or times
out). The engine runs an op to its end before it picks the next one, so "done" is "started" here.

Cost: the ops not run yet are kept as hint positions in heaps, so choosing and starting an op
do not scan them; starting ``F m`` pushes ``B m`` in, starting ``B m`` pushes ``W m``. A message
counts as in once ``arrive`` pushed it: then ``pick`` and ``started`` take O(log N) for N ops
(plus moving at most ``cap`` entries of the sorted list of backwards waiting for a gradient).
Or ``pick``'s ``arrived`` says it is in: it is asked only about the ops before the choice in the
hint that wait for a message (forwards only under the cap), one call each.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

from .memory import EPS as MEM_EPS
from .ops import Kind, Op

Arrived = Callable[[Kind, int], bool]  # (message kind Kind.F or Kind.B, micro-batch) -> is it in?


def _ANY(kind: Kind, mb: int) -> bool:
    return True


class ReadyRule:
    """The rule for one stage and one iteration: ``pick`` the next op, then ``started`` it.

    The ops not run yet, as hint positions, by what they wait for: ``_ready`` (a heap: B and W
    ops ready now), ``_f_ready`` (a heap: forwards whose activation is in, ready under the cap),
    ``_b_wait`` (sorted: backwards whose forward ran, waiting for their gradient; at most as many
    as the activations held) and ``_f_pos`` (every forward in hint order, the ones ``pick`` asks
    ``arrived`` about). An op waiting for its own forward or backward is in none of them until
    that one starts. A heap keeps an op that started until it reaches the top (``_done``).
    """

    def __init__(self, hint: Sequence[Op], cap: int, *, needs_input: bool, needs_grad: bool,
                 units: Optional[float] = None, w_share: float = 1.0):
        if cap < 1:
            raise ValueError(f"cap must be at least 1, not {cap}")
        if units is not None and units < 1:
            raise ValueError(f"units must be at least 1 (one micro-batch's activations), not {units}")
        self.units, self.w_share = units, w_share
        self.pend_w = 0  # micro-batches between their B and their W
        self._w_open: list[int] = []  # positions of the Ws whose B ran, not run yet (sorted)
        self._ops: list[Op] = [op.local() for op in hint]
        self.cap, self.needs_input, self.needs_grad = cap, needs_input, needs_grad
        self.forwarded: set[int] = set()
        self.backwarded: set[int] = set()
        self.inflight = 0
        self.peak = 0
        n = len(self._ops)
        self._end = n  # "no op": a position after every op
        self._done = [False] * n
        self._left = n
        self._head = 0  # every position before it has run
        self._at: dict[Op, list[int]] = {}  # op -> its positions not run yet, last = first in the hint
        self._after_f: dict[int, list[int]] = {}  # mb -> positions of the B ops F mb makes ready
        self._after_b: dict[int, list[int]] = {}  # mb -> positions of the other ops B mb makes ready
        self._in: set[tuple[Kind, int]] = set()  # messages pushed in by ``arrive``
        self._f_pos: list[int] = []
        self._f_lo = 0  # every forward of _f_pos before this index has run
        self._w_pos: list[int] = []  # the W ops in hint order: they run in this order
        self._w_next = 0  # index in _w_pos of the next W to run
        for i, op in enumerate(self._ops):
            self._at.setdefault(op, []).insert(0, i)
            if op.kind is Kind.F:
                self._f_pos.append(i)
            elif op.kind is Kind.B:
                self._after_f.setdefault(op.mb, []).append(i)
            elif op.kind is Kind.W:
                self._w_pos.append(i)
            else:
                self._after_b.setdefault(op.mb, []).append(i)
        self._ready: list[int] = []
        self._f_ready: list[int] = [] if needs_input else list(self._f_pos)  # increasing: a heap
        self._b_wait: list[int] = []

    @property
    def pending(self) -> "Pending":
        """The ops not run yet, in hint order (``pending[0]``: the first of them, O(1) amortized)."""
        return Pending(self)

    @property
    def finished(self) -> bool:
        return not self._left

    def _f_ok(self) -> bool:
        """One more forward fits: under the cap and within the memory budget."""
        return self.inflight < self.cap and (
            self.units is None or self.inflight + 1 + self.w_share * self.pend_w <= self.units + MEM_EPS)

    def is_ready(self, op: Op, arrived: Arrived) -> bool:
        if op.kind is Kind.F:
            return self._f_ok() and (not self.needs_input or arrived(Kind.F, op.mb))
        if op.kind is Kind.B:
            return op.mb in self.forwarded and (not self.needs_grad or arrived(Kind.B, op.mb))
        if op.kind is Kind.W:
            nxt = self._w_pos[self._w_next] if self._w_next < len(self._w_pos) else None
            return nxt is not None and self._ops[nxt] == op and op.mb in self.backwarded
        return op.mb in self.backwarded

    def w_in_turn(self, mb: int) -> bool:
        """Whether ``W mb`` may run now as far as the Ws' order goes (its B ran, every W before it in the
        hint ran): asked after a fused ``B mb`` started, whose W runs with it only then."""
        return self.is_ready(Op(Kind.W, mb), _ANY)

    def arrive(self, kind: Kind, mb: int) -> None:
        """The message (kind Kind.F or Kind.B, micro-batch) is in, and stays in for the iteration."""
        if (kind, mb) in self._in:
            return
        self._in.add((kind, mb))
        if kind == Kind.F and self.needs_input:
            for i in self._at.get(Op(Kind.F, mb), ()):
                heapq.heappush(self._f_ready, i)
        elif kind == Kind.B and self.needs_grad and mb in self.forwarded:
            for i in self._after_f.get(mb, ()):
                if not self._done[i]:
                    del self._b_wait[bisect_left(self._b_wait, i)]
                    heapq.heappush(self._ready, i)

    def pick(self, arrived: Optional[Arrived] = None) -> Optional[Op]:
        """The first op of the hint not run yet that is ready now; None if none is.

        A message counts as in once ``arrive`` pushed it, or if ``arrived`` says so: it is asked,
        in hint order, about the ops before the first one known ready that wait for a message,
        until one is in (each pick asks anew: messages may come between picks)."""
        done = self._done
        if self.units is not None and self.pend_w and \
                self.inflight - 1 + self.w_share * (self.pend_w + 1) > self.units + MEM_EPS:
            return self._ops[self._w_open[0]]  # a B would exceed the memory: the earliest W first
        best = self._end
        h = self._ready
        while h and done[h[0]]:
            heapq.heappop(h)
        if h:
            best = h[0]
        f_ok = self._f_ok()
        if not f_ok and self.inflight < self.cap and self._w_open and self._w_open[0] < best:
            best = self._w_open[0]  # the memory holds forwards back: free it with the earliest W ready
        if f_ok:
            h = self._f_ready
            while h and done[h[0]]:
                heapq.heappop(h)
            if h and h[0] < best:
                best = h[0]
        if arrived is not None:
            ops = self._ops
            for i in self._b_wait:  # ascending
                if i >= best:
                    break
                if arrived(Kind.B, ops[i].mb):
                    best = i
                    break
            if f_ok and self.needs_input:
                pos, lo = self._f_pos, self._f_lo
                while lo < len(pos) and done[pos[lo]]:
                    lo += 1
                self._f_lo = lo
                for j in range(lo, len(pos)):
                    i = pos[j]
                    if i >= best:
                        break
                    if not done[i] and arrived(Kind.F, ops[i].mb):
                        best = i
                        break
        return None if best == self._end else self._ops[best]

    def started(self, op: Op) -> None:
        at = self._at.get(op)
        if not at:
            raise ValueError(f"{op} is not an op of the hint still to run")
        i = at.pop()
        done = self._done
        done[i] = True
        self._left -= 1
        kind, mb = op.kind, op.mb
        if kind == Kind.F:
            if mb not in self.forwarded:
                self.forwarded.add(mb)
                after = self._after_f.get(mb, ())
                if self.needs_grad and not (self._in and (Kind.B, mb) in self._in):
                    for j in after:
                        if not done[j]:
                            insort(self._b_wait, j)
                else:
                    for j in after:
                        if not done[j]:
                            heapq.heappush(self._ready, j)
            self.inflight += 1
            if self.inflight > self.peak:
                self.peak = self.inflight
        elif kind == Kind.B:
            w = self._b_wait
            if w:
                k = bisect_left(w, i)
                if k < len(w) and w[k] == i:
                    del w[k]
            if mb not in self.backwarded:
                self.backwarded.add(mb)
                for j in self._after_b.get(mb, ()):
                    if not done[j]:
                        heapq.heappush(self._ready, j)
                for j in self._at.get(Op(Kind.W, mb), ()):
                    if not done[j]:
                        insort(self._w_open, j)
                self._push_next_w()
                self.pend_w += 1
            self.inflight -= 1
        elif kind == Kind.W:  # a W run early to free memory starts before the Ws ahead of it: skip it then
            k = bisect_left(self._w_open, i)
            if k < len(self._w_open) and self._w_open[k] == i:
                del self._w_open[k]
            self.pend_w -= 1
            self._push_next_w()

    def _push_next_w(self) -> None:
        """The next W in hint order not run yet is ready once its B ran."""
        w, done = self._w_pos, self._done
        while self._w_next < len(w) and done[w[self._w_next]]:
            self._w_next += 1
        if self._w_next < len(w):
            j = self._w_pos[self._w_next]
            if not self._done[j] and self._ops[j].mb in self.backwarded:
                heapq.heappush(self._ready, j)

    def hold(self, op: Op, now: float, op_time: Optional[float],
             expected: Callable[[tuple[Kind, int]], Optional[float]]) -> Optional[tuple[tuple[Kind, int], float]]:
        """Patience: ``(message, until)`` if the stage should wait for ``message`` (at most until
        ``until``) instead of starting ``op``, the op ``pick`` chose; else None.

        It waits when ``op`` is not the hint's first op still to run, that op needs only its message
        (kind, micro-batch) to be ready, and ``expected(message)`` (None: not known) comes before
        ``op`` would end if it started ``now`` (``op_time`` long; None: not known). ``until`` is the
        expected time (or ``now``, if it is past) plus a tenth of ``op_time``. Any unit of time."""
        if op_time is None:
            return None
        head = self.pending[0]
        if op == head:
            return None
        msg = self.message_of(head)
        if msg is None or not self.is_ready(head, _ANY):
            return None
        due = expected(msg)
        if due is None or now + op_time <= due:
            return None
        return msg, max(due, now) + op_time / 10

    def message_of(self, op: Op):
        """The message ``op`` waits for, as (kind, micro-batch), or None."""
        if op.kind is Kind.F and self.needs_input:
            return (Kind.F, op.mb)
        if op.kind is Kind.B and self.needs_grad:
            return (Kind.B, op.mb)
        return None

    def waiting_for(self) -> list[str]:
        """The messages the ops still to run wait for (for an error message), e.g. ``['RECV_B3']``."""
        out = []
        for op in self.pending:
            if op.kind is Kind.F and self.needs_input:
                out.append(str(Op(Kind.RECV_F, op.mb)))
            elif op.kind is Kind.B and self.needs_grad:
                out.append(str(Op(Kind.RECV_B, op.mb)))
        return out


class Pending(Sequence):
    """The ops of a ``ReadyRule`` not run yet, in hint order: a view, not a copy."""

    def __init__(self, rule: ReadyRule):
        self._rule = rule

    def __len__(self) -> int:
        return self._rule._left

    def __getitem__(self, k):
        r = self._rule
        if k == 0 and r._left:
            while r._done[r._head]:
                r._head += 1
            return r._ops[r._head]
        return list(self)[k]

    def __iter__(self) -> Iterator[Op]:
        r = self._rule
        return (r._ops[i] for i in range(r._head, len(r._ops)) if not r._done[i])

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, Pending)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Pending({list(self)!r})"
