"""``control.rebalance``: the rebalance loop's decisions from recorded stage times.

The stage times fed here are what the engine measures for 4 stages x 4 layers of equal cost
(2.5 ms F, B and W per layer: 10 ms per op per stage), with stage 1 slowed 2x from some iteration.
Expected partitions are derived by hand or by enumerating every partition one migration step can
reach (the exact answer the branch-and-bound search must match).
"""
from __future__ import annotations

import functools
import itertools
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_pipemorph.control.rebalance import Rebalancer, best_step, reachable
from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.ir.memory import MemoryBudget
from ds_pipemorph.plan.partition.layer_profile import LayerProfile
from ds_pipemorph.plan.partition.partition import evaluate
from ds_pipemorph.plan.partition.parts import layer_moves

S, N, L = 4, 12, 16
UNIFORM = [0, 4, 8, 12, 16]
HEALTHY = [[10.0, 10.0, 10.0]] * S


def _slowed(parts, factor=2.0, stage=1, per_layer=2.5):
    """What each stage measures under ``parts`` with ``stage`` slowed by ``factor``."""
    return [[per_layer * (parts[s + 1] - parts[s]) * (factor if s == stage else 1.0)] * 3 for s in range(S)]


def _rebalancer(**kw) -> Rebalancer:
    return Rebalancer(S, N, UNIFORM, caps=[N] * S, **kw)


def _reachable(old):
    """Every partition one migration step reaches (each layer moves at most to a neighbour)."""
    for cut in itertools.combinations(range(1, L), S - 1):
        parts = [0, *cut, L]
        try:
            layer_moves(old, parts)
        except BadInput:
            continue
        yield parts


def test_layer_costs_are_learned_after_the_first_iteration_and_split_by_parameter_count():
    rb = _rebalancer(warmup=2)
    weights = [1.0] * L
    weights[0] = 3.0  # layer 0 holds 3/6 of stage 0's parameters: half of its time
    assert rb.observe([[99.0] * 3] * S, weights) is None  # skipped: start-up work
    assert rb.observe(HEALTHY, weights) is None and rb.profile is None
    assert rb.observe(HEALTHY, weights) is None
    lp = rb.profile
    assert lp.layers.forward_ms[0] == pytest.approx(5.0) and lp.layers.forward_ms[1] == pytest.approx(5.0 / 3)
    assert lp.layers.forward_ms[4:8] == pytest.approx([2.5] * 4)
    assert rb.slowdowns(_slowed(UNIFORM)) == pytest.approx([1.0, 2.0, 1.0, 1.0])


def test_a_stage_slowed_twice_loses_layers_after_patience_iterations():
    rb = _rebalancer(warmup=1, patience=2)
    rb.observe(HEALTHY)
    rb.observe(HEALTHY)  # learned: 2.5 ms per layer and op
    assert rb.observe(HEALTHY) is None
    assert rb.observe(_slowed(UNIFORM)) is None  # one slow iteration is not yet a straggler
    d = rb.observe(_slowed(UNIFORM))
    assert d is not None and d.slowdown == pytest.approx([1.0, 2.0, 1.0, 1.0])
    # Per micro-batch, a layer costs 7.5 ms (15 on stage 1). Stage 1 with k layers costs 15k, the
    # other 16 - k layers over 3 stages at least 7.5 ceil((16 - k) / 3): k = 1 or 2 gives the
    # least bottleneck, 37.5 ms, against 60 ms for the uniform cut.
    bottleneck = max((d.parts[s + 1] - d.parts[s]) * 7.5 * (2 if s == 1 else 1) for s in range(S))
    assert d.parts[2] - d.parts[1] in (1, 2) and bottleneck == 37.5
    # The proposal is the best partition one step reaches, by exhaustive enumeration.
    lp, slow = rb.profile, d.slowdown
    best = min(evaluate(lp, p, slowdown=slow) for p in _reachable(UNIFORM))
    assert d.predicted_ms == pytest.approx(best, abs=1e-6)
    assert d.current_ms == pytest.approx(evaluate(lp, UNIFORM, slowdown=slow))
    assert d.predicted_ms < d.current_ms * 0.7
    for ops in d.plan:  # a plan for every stage, each micro-batch's F once
        assert sorted(str(o) for o in ops if str(o).startswith("F")) == sorted(f"F{m}" for m in range(N))


def test_after_the_move_the_same_slowdown_is_not_acted_on_again_and_recovery_moves_back():
    rb = _rebalancer(warmup=1, patience=2)
    for _ in range(2):
        rb.observe(HEALTHY)
    rb.observe(_slowed(UNIFORM))
    d = rb.observe(_slowed(UNIFORM))
    rb.moved(d.parts)
    for _ in range(4):  # still 2x on stage 1, now with fewer layers there: nothing to do
        assert rb.observe(_slowed(d.parts)) is None
    rb.observe(_slowed(d.parts, factor=1.0))
    back = rb.observe(_slowed(d.parts, factor=1.0))  # the straggler recovered
    assert back is not None and back.slowdown == pytest.approx([1.0] * S)
    assert back.parts[2] - back.parts[1] > d.parts[2] - d.parts[1]


def test_noise_below_the_threshold_and_too_small_a_gain_change_nothing():
    rb = _rebalancer(warmup=1, patience=2, noise=0.15)
    for _ in range(2):
        rb.observe(HEALTHY)
    for f in (1.1, 0.92, 1.12, 1.1):  # within 15 %
        assert rb.observe(_slowed(UNIFORM, factor=f)) is None
    for stage in (1, 2, 1, 3, 0, 2):  # beyond it, but a different stage each iteration: noise
        assert rb.observe(_slowed(UNIFORM, factor=1.6, stage=stage)) is None
    assert rb.observe(_slowed(UNIFORM, factor=1.6, stage=2)) is not None  # stage 2 twice in a row
    rb2 = _rebalancer(warmup=1, patience=1, noise=0.01, min_gain=0.5)
    for _ in range(2):
        rb2.observe(HEALTHY)
    assert rb2.observe(_slowed(UNIFORM, factor=1.3)) is None  # some gain, far below 50 %
    assert rb2.reference == pytest.approx([1.0, 1.3, 1.0, 1.0])  # the new normal: not re-examined each iteration


def test_a_failed_migration_is_retried_at_the_next_detection():
    rb = _rebalancer(warmup=1, patience=1)
    for _ in range(2):
        rb.observe(HEALTHY)
    d = rb.observe(_slowed(UNIFORM))
    assert d is not None
    rb.failed()
    again = rb.observe(_slowed(UNIFORM))
    assert again is not None and again.parts == d.parts


def test_reachable_partitions_are_those_whose_layers_move_to_neighbours_only():
    # Independent: every cut of 16 layers into 4 stages, kept if layer_moves accepts it.
    every = [[0, *c, L] for c in itertools.combinations(range(1, L), S - 1)]
    for old in (UNIFORM, [0, 1, 2, 3, 16], [0, 7, 8, 9, 16]):
        want = sorted(p for p in every if _moves_ok(old, p))
        assert sorted(reachable(old)) == want
    # Pinning layer 4 (a tied layer, say) keeps it on stage 1.
    assert all(p[1] <= 4 < p[2] for p in reachable(UNIFORM, pinned=[4]))


def _moves_ok(old, new) -> bool:
    try:
        layer_moves(old, new)
    except BadInput:
        return False
    return True


def test_the_proposed_step_is_the_best_partition_one_step_reaches():
    rng = random.Random(7)
    for _ in range(60):
        L_, S_ = rng.randint(3, 9), rng.randint(2, 4)
        S_ = min(S_, L_)
        lp = LayerProfile.model_validate({"stages": S_, "microbatches": rng.randint(2, 8), "layers": {
            "forward_ms": [rng.choice([1, 2, 3, 5]) for _ in range(L_)], "backward_input_ms": 1.0,
            "backward_weight_ms": [rng.choice([0.5, 1, 2]) for _ in range(L_)]}})
        old = [0, *sorted(rng.sample(range(1, L_), S_ - 1)), L_]
        slow = [rng.choice([1.0, 1.0, 1.5, 2.0, 3.0]) for _ in range(S_)]
        step, ms = best_step(lp, old, slow)
        every = [[0, *c, L_] for c in itertools.combinations(range(1, L_), S_ - 1)]
        best = min(evaluate(lp, p, slowdown=slow) for p in every if _moves_ok(old, p))
        assert _moves_ok(old, step) and ms == pytest.approx(best, abs=1e-6), (old, slow, step)


def test_the_best_reachable_step_when_the_windows_hold_many_invalid_cuts():
    # 16 layers, 5 stages: the boundary windows multiply to 2700 cuts, of which 733 are partitions;
    # all of them must be scored (a descent from the clamped optimum stops at 239.25 ms here).
    lp = LayerProfile.model_validate({"stages": 5, "microbatches": 5, "memory": {"max_inflight": [2] * 5},
                                      "layers": {"forward_ms": [2, 1, 3, 1, 1, 2, 1, 2, 1, 5, 3, 5, 5, 5, 2, 1],
                                                 "backward_input_ms": 1.0,
                                                 "backward_weight_ms": [1, 2, 1, .5, 2, .5, .5, 1, 1, .5, 1, 1, 1,
                                                                        .5, .5, 2]}})
    old, slow = [0, 2, 4, 7, 12, 16], [3, 1, 1.5, 1, 2]
    every = [[0, *c, 16] for c in itertools.combinations(range(1, 16), 4)]
    best = min(evaluate(lp, p, slowdown=slow) for p in every if _moves_ok(old, p))
    step, ms = best_step(lp, old, slow)
    assert _moves_ok(old, step) and ms == pytest.approx(best, abs=1e-6)


def test_a_rebalancer_never_moves_a_pinned_layer():
    rb = Rebalancer(S, N, UNIFORM, caps=[N] * S, warmup=1, patience=1, pinned=(4, 5, 6, 7))
    for _ in range(2):
        rb.observe(HEALTHY)
    d = rb.observe(_slowed(UNIFORM))  # stage 1 slowed, but it must keep layers 4-7
    assert d is None or (d.parts[1] <= 4 and d.parts[2] >= 8)


def test_a_move_made_while_layer_costs_are_learned_restarts_the_learning_on_the_new_partition():
    # Iteration 1 is measured on UNIFORM; the layers then move (engine.repartition). Splitting that
    # iteration's stage times over the new partition's layers would be wrong, so learning starts
    # again: the costs come from iterations on the new partition only, 2.5 ms per layer.
    rb = _rebalancer(warmup=2)
    weights = [1.0] * L
    new = [0, 6, 8, 12, 16]
    rb.observe(HEALTHY, weights)  # start-up, skipped
    rb.observe(_slowed(UNIFORM, factor=3.0, stage=0), weights)  # on the old partition
    rb.moved(new)
    assert rb.profile is None and rb.parts == new
    rb.observe(_slowed(new, factor=1.0), weights)
    assert rb.profile is None  # one iteration on the new partition so far
    rb.observe(_slowed(new, factor=1.0), weights)
    assert rb.profile.layers.forward_ms == pytest.approx([2.5] * L)


# -- a stage slow from the first iteration ------------------------------------------------------
# The engine hands each layer's weight (parameter count) and its class (type and parameter shapes;
# for a function, its name and the module it computes with); the 16 layers below are one class
# unless a test says otherwise.
BLOCK = 72  # parameters of one block (an 8 x 8 Linear with bias)
SAME = [1] * L


def _from_start(rb: Rebalancer, rows, weights=None, classes=SAME, iterations=6):
    """Feeds ``rows`` (every iteration the same) from iteration 0; returns the decisions by iteration."""
    weights = [BLOCK] * L if weights is None else weights
    return {k: d for k in range(iterations) if (d := rb.observe(rows, weights, classes)) is not None}


def test_a_stage_slowed_from_the_first_iteration_loses_layers_after_warmup_and_patience():
    rb = _rebalancer(warmup=2, patience=2)
    decisions = _from_start(rb, _slowed(UNIFORM))
    # Iteration 0 is start-up, 1-2 learn (stages 0, 2, 3: 2.5 ms per block and op, stage 1: 5), 3-4
    # detect: the decision comes at iteration 4, once.
    assert list(decisions) == [4]
    assert rb.profile.layers.forward_ms == pytest.approx([2.5] * L)
    d = decisions[4]
    assert d.slowdown == pytest.approx([1.0, 2.0, 1.0, 1.0])
    # By hand, per micro-batch a block costs 7.5 ms (15 on stage 1); a stage's iteration is at least
    # the moment its first F can start plus its work. Uniform: stage 1 starts after stage 0's F (10)
    # and works 12 x 60: 730. One step from it, stage 1 keeps 1 or 2 blocks (3 would cost 45 per
    # micro-batch, above what the others need). With 2, stages 0, 2, 3 carry 14: one of 2 and 3
    # carries 5 (37.5 per micro-batch, 450 in all; 6 on stage 0 is 540). Best: 5 on stage 2, which
    # starts after stage 0's F (5 blocks: 12.5) and stage 1's (10): 472.5; 5 on stage 3 starts at
    # 32.5. With 1 block on stage 1, all three others carry 5 and stage 3 starts at 30: 480.
    assert d.current_ms == pytest.approx(730.0)
    assert d.parts == [0, 5, 7, 12, 16] and d.predicted_ms == pytest.approx(472.5)


def test_uniform_stages_of_one_class_move_nothing():
    rb = _rebalancer(warmup=2, patience=2)
    jitter = [[10.0 * f] * 3 for f in (1.0, 1.06, 0.95, 1.03)]  # within noise
    assert _from_start(rb, jitter, iterations=12) == {}
    assert rb.slowdowns(jitter) == pytest.approx([1.0, 1.06, 0.95, 1.03])


def test_the_reference_is_the_median_stage_so_neither_a_slow_nor_a_fast_one_sets_it():
    # Per block (F + B + W): 6, 15, 7.5, 7.5 ms. Sorted, the lower middle one is 7.5.
    rows = [[2.0 * 4] * 3, [5.0 * 4] * 3, [2.5 * 4] * 3, [2.5 * 4] * 3]
    rb = _rebalancer(warmup=1)
    _from_start(rb, rows, iterations=2)
    assert rb.slowdowns(rows) == pytest.approx([0.8, 2.0, 1.0, 1.0])


def test_without_a_class_shared_across_stages_the_costs_are_learned_as_before():
    # Every stage's layers a class of their own: nothing to compare, so each stage's time is split
    # among its own layers and a stage slow from the start looks healthy.
    own = [s for s in range(S) for _ in range(4)]
    rb, before = _rebalancer(warmup=2), _rebalancer(warmup=2)
    assert _from_start(rb, _slowed(UNIFORM), classes=own, iterations=10) == {}
    _from_start(before, _slowed(UNIFORM), classes=None, iterations=3)
    assert rb.profile.layers.forward_ms == pytest.approx(before.profile.layers.forward_ms)
    assert rb.profile.layers.forward_ms[4:8] == pytest.approx([5.0] * 4)
    assert rb.slowdowns(_slowed(UNIFORM)) == pytest.approx([1.0] * S)


EMBED, HEAD = 2, 3  # classes of an embedding (layer 0) and of a head (layer 15)


def _with_ends(factor=1.0):
    """Stage 0 holds an embedding (8 x the block's parameters, but 1 ms per op) and 3 blocks, stage 3
    3 blocks and a head (4 ms per op); stage 1 slowed by ``factor``. Blocks cost 2.5 ms per op."""
    weights = [BLOCK] * L
    weights[0], weights[15] = 8 * BLOCK, 4 * BLOCK
    classes = [1] * L
    classes[0], classes[15] = EMBED, HEAD
    rows = [[1.0 + 3 * 2.5] * 3, [4 * 2.5 * factor] * 3, [4 * 2.5] * 3, [3 * 2.5 + 4.0] * 3]
    return rows, weights, classes


def test_an_embedding_and_a_head_are_not_mistaken_for_stragglers():
    rows, weights, classes = _with_ends()
    rb = _rebalancer(warmup=2)
    assert _from_start(rb, rows, weights, classes, iterations=10) == {}
    # Blocks from stages 1 and 2 (each holds nothing else); the embedding and the head take what
    # their stage's time leaves (8.5 - 7.5 and 11.5 - 7.5), not a share by parameter count (which
    # would give the embedding 8 / 11 of 8.5 ms).
    assert rb.profile.layers.forward_ms == pytest.approx([1.0] + [2.5] * 14 + [4.0])
    assert rb.slowdowns(rows) == pytest.approx([1.0] * S)


def test_with_an_embedding_and_a_head_a_stage_slowed_from_the_start_still_loses_layers():
    rows, weights, classes = _with_ends(factor=2.0)
    rb = _rebalancer(warmup=2, patience=2)
    decisions = _from_start(rb, rows, weights, classes)
    assert list(decisions) == [4]
    d = decisions[4]
    assert d.slowdown == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert d.parts[2] - d.parts[1] < 4 and d.predicted_ms < d.current_ms


def test_a_layer_without_parameters_joins_no_class_and_costs_nothing_beside_blocks():
    weights = [BLOCK] * L
    weights[9] = 0  # a reshape on stage 2: its stage still holds only blocks that count
    classes = list(SAME)
    classes[9] = 0
    rows = _slowed(UNIFORM)
    rows[2] = [3 * 2.5] * 3
    rb = _rebalancer(warmup=1)
    _from_start(rb, rows, weights, classes, iterations=2)
    assert rb.profile.layers.forward_ms == pytest.approx([2.5] * 9 + [0.0] + [2.5] * 6)
    assert rb.slowdowns(rows) == pytest.approx([1.0, 2.0, 1.0, 1.0])


def test_with_a_layer_profile_a_stage_slowed_from_the_first_iteration_is_seen_at_once():
    lp = LayerProfile.model_validate({"stages": S, "microbatches": N, "layers": {
        "forward_ms": [2.5] * L, "backward_input_ms": 2.5, "backward_weight_ms": 2.5}})
    rb = _rebalancer(patience=2, profile=lp)
    assert rb.observe([[99.0] * 3] * S) is None  # start-up work: not a slowdown
    assert rb.observe(_slowed(UNIFORM)) is None
    d = rb.observe(_slowed(UNIFORM))  # iteration 2: the second slowed one
    assert d is not None and d.slowdown == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert d.parts == [0, 5, 7, 12, 16] and d.predicted_ms == pytest.approx(472.5)


# -- a head that is a function, not a module ------------------------------------------------------
# DeepSpeed keeps a tied head (``TiedLayerSpec`` with a ``forward_fn``) as a partial of that
# function and the tied module, and a plain function layer as itself: no parameters of its own, but
# it may cost as much as blocks. The engine gives it a class of its own (weight 0 here: a function
# computing with no module). Layer 15 below is such a head: 4 ms per op; blocks 2.5 ms per op.
FUNC_HEAD = 5


def _with_head_function(factor=1.0, head_class=FUNC_HEAD):
    weights, classes = [BLOCK] * L, [1] * L
    weights[15], classes[15] = 0, head_class
    rows = [[4 * 2.5] * 3, [4 * 2.5 * factor] * 3, [4 * 2.5] * 3, [3 * 2.5 + 4.0] * 3]
    return rows, weights, classes


def test_a_head_function_beside_blocks_is_not_mistaken_for_a_straggler():
    rows, weights, classes = _with_head_function()
    rb = _rebalancer(warmup=2, patience=2)
    assert _from_start(rb, rows, weights, classes, iterations=10) == {}
    # Stage 3 holds blocks and the head: two classes, so the blocks' 2.5 ms come from stages 0-2
    # (each holds blocks alone) and the head takes what stage 3's 11.5 ms leave: 4.
    assert rb.profile.layers.forward_ms == pytest.approx([2.5] * 15 + [4.0])
    assert rb.slowdowns(rows) == pytest.approx([1.0] * S)
    # Were the head free (class 0, as a module without parameters is), stage 3 would hold blocks
    # alone and read 11.5 / (3 x 2.5) = 1.533: healthy, but seen as slow from the start.
    free = _rebalancer(warmup=2)
    _from_start(free, *_with_head_function(head_class=0), iterations=3)
    assert free.slowdowns(rows) == pytest.approx([1.0, 1.0, 1.0, 11.5 / 7.5])


def test_with_a_head_function_a_stage_slowed_from_the_start_still_loses_layers():
    rows, weights, classes = _with_head_function(factor=2.0)
    rb = _rebalancer(warmup=2, patience=2)
    decisions = _from_start(rb, rows, weights, classes)
    # Blocks per op: 2.5, 5, 2.5 on stages 0-2; the median (lower middle) is 2.5. The head: 4.
    assert rb.profile.layers.forward_ms == pytest.approx([2.5] * 15 + [4.0])
    assert list(decisions) == [4]
    d = decisions[4]
    assert d.slowdown == pytest.approx([1.0, 2.0, 1.0, 1.0])
    # By hand, per micro-batch a block costs 7.5 ms (15 on stage 1), the head 12. Uniform: stage 1
    # starts after stage 0's F (10) and works 12 x 60: 730 (stage 3: 3 x 7.5 + 12 = 34.5 per
    # micro-batch, 414 from 30). The move of the test without the head, [0, 5, 7, 12, 16], still
    # wins: stage 2 (5 blocks, 450) starts after 12.5 + 10: 472.5, and stage 3 (3 blocks and the
    # head, 414) after 35: 449. Stage 3 cannot take a fourth block (42 per micro-batch, 504 in all),
    # and with 1 block on stage 1 stages 0 and 2 carry 12 between them: 6 on one, 540.
    assert d.current_ms == pytest.approx(730.0)
    assert d.parts == [0, 5, 7, 12, 16] and d.predicted_ms == pytest.approx(472.5)
    best = min(evaluate(rb.profile, p, slowdown=d.slowdown) for p in _reachable(UNIFORM))
    assert d.predicted_ms == pytest.approx(best, abs=1e-6)


# -- what the engine reports for a layer (``runtime.rebalance_loop``) ---------------------------------
def _tied_head(embedding, x):
    """A tied output head as DeepSpeed models write one: the embedding's weight as the projection."""
    return x @ embedding.weight.t()


def test_a_function_layer_with_a_module_has_a_signature_of_its_own_and_one_without_none():
    import torch

    from ds_pipemorph.runtime.rebalance_loop import layer_signature, layer_weight

    emb = torch.nn.Embedding(32, 8)
    head = functools.partial(_tied_head, emb)
    sig = layer_signature(head)
    assert 0 < sig < 2**53  # exact in the float64 row
    # The same function with an equal module (another object) is the same class; another shape,
    # the module itself, or the same function with another bound module is another.
    assert layer_signature(functools.partial(_tied_head, torch.nn.Embedding(32, 8))) == sig
    others = {layer_signature(functools.partial(_tied_head, torch.nn.Embedding(64, 8))), layer_signature(emb),
              layer_signature(emb.forward)}
    assert sig not in others and 0 not in others and len(others) == 3
    assert layer_signature(emb.forward) == layer_signature(torch.nn.Embedding(32, 8).forward)  # by its module
    # A function without a module (a flatten lambda between blocks) is free, as a module without
    # parameters is.
    assert layer_signature(_tied_head) == layer_signature(lambda x: x.flatten(1)) == layer_signature(torch.relu) == 0
    # Weights: a function's is its module's parameters, 0 without one; a module's are its own.
    assert layer_weight(head) == 32 * 8 and layer_weight(_tied_head) == 0 and layer_weight(emb) == 32 * 8
    assert layer_signature(torch.nn.GELU()) == 0 and layer_weight(torch.nn.Dropout()) == 0


def test_a_function_layers_signature_is_the_same_in_another_process():
    import torch

    from ds_pipemorph.runtime.rebalance_loop import layer_signature

    sig = layer_signature(functools.partial(_tied_head, torch.nn.Embedding(32, 8)))
    name = _tied_head.__module__  # as this run imported this file; the child imports it so too
    code = (f"import functools, importlib.util, sys, torch\n"
            f"spec = importlib.util.spec_from_file_location({name!r}, {__file__!r})\n"
            f"mod = importlib.util.module_from_spec(spec); sys.modules[{name!r}] = mod; spec.loader.exec_module(mod)\n"
            f"from ds_pipemorph.runtime.rebalance_loop import layer_signature\n"
            f"print(layer_signature(functools.partial(mod._tied_head, torch.nn.Embedding(32, 8))))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) == sig


def _engine(stage: int, parts: list[int], funcs: list) -> SimpleNamespace:
    """What ``RebalanceLoop`` reads of an engine: a 2-stage pipeline, this rank on ``stage``."""
    cfg = SimpleNamespace(layer_profile=None, noise=0.15, patience=2, min_gain=0.05, warmup_iterations=2)
    module = SimpleNamespace(_num_layers=parts[-1], _layer_specs=[None] * parts[-1], parts=parts,
                             forward_funcs=funcs, _local_start=parts[stage])
    return SimpleNamespace(pipemorph=SimpleNamespace(rebalance=cfg), num_stages=2, micro_batches=4, stage_id=stage,
                           module=module)


def test_the_engine_row_reports_a_tied_head_and_describes_a_stage_once_per_partition(monkeypatch):
    import torch

    from ds_pipemorph.runtime import rebalance_loop

    emb = torch.nn.Embedding(32, 8)
    blocks = [torch.nn.Linear(8, 8) for _ in range(3)]
    act, head = torch.nn.GELU(), functools.partial(_tied_head, emb)
    engine = _engine(1, [0, 2, 6], [blocks[1], act, blocks[2], head])
    loop = rebalance_loop.RebalanceLoop(engine, MemoryBudget((4, 4)))
    calls = []
    real = rebalance_loop.layer_signature
    monkeypatch.setattr(rebalance_loop, "layer_signature", lambda layer: calls.append(layer) or real(layer))
    row = loop.row(engine, [])
    weights, signatures = row[6:12].tolist(), [int(x) for x in row[12:18].tolist()]
    assert weights == [0, 0, 72, 0, 72, 256]
    assert signatures[:2] == [0, 0] and signatures[3] == 0  # not held here; the activation is free
    assert signatures[2] == signatures[4] == real(blocks[0]) and signatures[5] == real(head) != 0
    assert len(calls) == 4
    assert torch.equal(loop.row(engine, []), row) and len(calls) == 4  # the same partition: no recompute
    engine.module.forward_funcs, engine.module.parts, engine.module._local_start = [act, blocks[2], head], [0, 3, 6], 3
    row = loop.row(engine, [])  # after a migration: described again
    assert len(calls) == 7 and row[6:12].tolist() == [0, 0, 0, 0, 72, 256]
