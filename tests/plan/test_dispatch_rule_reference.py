"""``plan.ir.ready_rule.ReadyRule`` (heaps of hint positions) against a plain scan of the documented rule
(``docs/ready_dispatch.md``): same pick at every step, whether messages are asked for (``pick``'s
``arrived``), pushed in (``arrive``) or both, on random hints, caps and arrival orders."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.plan.ir.ops import Op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.ir.ready_rule import ReadyRule
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import initial_warmup


class ScanRule:
    """The rule as written: among the ops not run yet, the first of the hint that is ready. ``fused``:
    the micro-batches whose B is directly followed by its W in the hint (a fused backward)."""

    def __init__(self, hint, cap, needs_input, needs_grad, fused=False):
        self.pending = list(hint)
        self.fused = {a.mb for a, b in zip(hint, hint[1:]) if a.kind == "B" and b == Op("W", a.mb)} if fused else set()
        self.cap, self.needs_input, self.needs_grad = cap, needs_input, needs_grad
        self.forwarded, self.backwarded = set(), set()
        self.inflight = self.peak = 0

    def ready(self, op, arrived):
        if op.kind == "F":  # its activation is in (stage 0: always), fewer activations held than the cap
            return self.inflight < self.cap and (not self.needs_input or arrived("F", op.mb))
        if op.kind == "B":  # its own forward is done, its gradient is in (last stage: none needed)
            return op.mb in self.forwarded and (not self.needs_grad or arrived("B", op.mb))
        # W: its own backward is done, and it is the first W still to run (Ws run in hint order)
        return op.mb in self.backwarded and self._first_w() == op

    def _first_w(self):
        return next((o for o in self.pending if o.kind == "W"), None)

    def pick(self, arrived):
        return next((op for op in self.pending if self.ready(op, arrived)), None)

    def started(self, op):
        self.pending.remove(op)
        if op.kind == "F":
            self.forwarded.add(op.mb)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
        elif op.kind == "B":
            self.backwarded.add(op.mb)
            self.inflight -= 1


def _hint(rng: random.Random, N: int) -> list[Op]:
    r = rng.random()
    if r < 0.4:  # a plan's row: warm-up forwards, then the list scheduler's interleaving
        S = rng.randint(2, 4)
        rows = list_schedule(Costs.uniform(S, 10.0), N, initial_warmup([rng.randint(1, N) for _ in range(S)]))
        return list(rng.choice(rows))
    ops = [Op(k, m) for m in range(N) for k in "FBW"]
    if r < 0.9:  # any order is a hint, dependencies or not
        return rng.sample(ops, len(ops))
    # not a valid hint (repeats, missing ops): the rule still behaves as the scan does
    return [rng.choice(ops) for _ in range(rng.randint(0, 3 * N + 3))]


def _drive(seed: int) -> None:
    rng = random.Random(seed)
    N = rng.randint(1, 14)
    hint = _hint(rng, N)
    cap = rng.randint(1, N + 1)
    needs_input, needs_grad = rng.random() < 0.7, rng.random() < 0.7
    messages = sorted({("F", op.mb) for op in hint if op.kind == "F" and needs_input}
                      | {("B", op.mb) for op in hint if op.kind == "B" and needs_grad})
    rng.shuffle(messages)
    mode = rng.choice(["ask", "push", "both"])
    fused = len(set(hint)) == len(hint) and rng.random() < 0.5  # a fused backward: a valid hint's
    ref = ScanRule(hint, cap, needs_input, needs_grad, fused)
    rule = ReadyRule(hint, cap, needs_input=needs_input, needs_grad=needs_grad)
    came: set = set()

    def start(op):  # as the engine and the replay do: a fused B's W runs with it when it is that W's turn
        ref.started(op)
        rule.started(op)
        if op.kind == "B" and op.mb in ref.fused:
            w = Op("W", op.mb)
            turn = w in ref.pending and ref.ready(w, arrived)
            assert rule.w_in_turn(op.mb) == turn, (seed, hint, ref.pending)
            if turn:
                ref.started(w)
                rule.started(w)

    def arrived(kind, mb):
        return (kind, mb) in came

    for _ in range(20 * len(hint) + 20):
        if messages and rng.random() < 0.4:  # one more message arrives
            msg = messages.pop()
            came.add(msg)
            if mode == "push" or (mode == "both" and rng.random() < 0.5):
                rule.arrive(*msg)
            continue
        want = ref.pick(arrived)
        got = rule.pick(None if mode == "push" else arrived)
        assert got == want, (seed, mode, hint, cap, sorted(came), ref.pending)
        if want is None and not messages:
            break
        if want is not None and rng.random() < 0.85:  # start it (else: the stage waits and picks again)
            start(want)
        elif ref.pending and rng.random() < 0.1:  # starting an op the rule did not pick is allowed too
            start(rng.choice(ref.pending))
        assert list(rule.pending) == ref.pending
        assert (rule.pending[0] if rule.pending else None) == (ref.pending[0] if ref.pending else None)
        assert rule.finished == (not ref.pending)
        assert (rule.inflight, rule.peak, rule.forwarded, rule.backwarded) == \
            (ref.inflight, ref.peak, ref.forwarded, ref.backwarded)
    assert rule.waiting_for() == [f"RECV_{op.kind}{op.mb}" for op in ref.pending
                                  if (op.kind == "F" and needs_input) or (op.kind == "B" and needs_grad)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_heap_rule_picks_what_a_scan_of_the_hint_picks(seed):
    _drive(seed)


def test_the_heap_rule_picks_what_a_scan_picks_on_fixed_seeds():
    for seed in range(300):
        _drive(seed)


def test_starting_an_op_that_is_not_pending_is_refused_and_changes_nothing():
    rule = ReadyRule([Op("F", 0), Op("B", 0), Op("W", 0)], 1, needs_input=False, needs_grad=False)
    rule.started(rule.pick())
    try:
        rule.started(Op("F", 0))
    except ValueError:
        pass
    else:  # pragma: no cover
        raise AssertionError("a second F0 was accepted")
    assert (rule.inflight, list(rule.pending)) == (1, [Op("B", 0), Op("W", 0)])
    assert rule.pick() == Op("B", 0)
