"""Per-stage slowdown factors in partitioning (``plan.partition``, ``LayerProfile.costs``): the branch
and bound equals exhaustive search with random factors, a hand-derived case, the factors scale
stage times and not links, the block-shift moves, and bad factors are one sentence."""
import math
import random

import pytest
from layer_cases import random_layer_data

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.partition.layer_profile import LayerProfile, check_slowdown
from ds_pipemorph.plan.partition.partition import block_shifts, compositions, evaluate, exhaustive, partition, quick_ms
from ds_pipemorph.plan.sched.bounds import cap_bound_ms, lower_bound_ms


def layer_profile(**kw) -> LayerProfile:
    return LayerProfile.model_validate(kw)


def random_case(rng: random.Random) -> tuple[LayerProfile, list[float]]:
    """Up to 10 layers, 4 stages, 10 micro-batches, as in test_partition.py, and one factor per
    stage: mostly 1, else from a little to much slower (and one faster than profiled)."""
    d = random_layer_data(rng, capacity_p=0.4)
    S = d["stages"]
    slow = [rng.choice([1.0, 1.0, 1.25, 1.5, 2.0, 3.0, 0.5, rng.uniform(1, 4)]) for _ in range(S)]
    return LayerProfile.model_validate(d), slow


def test_branch_and_bound_equals_exhaustive_search_with_random_slowdowns():
    rng = random.Random(17)
    checked = 0
    for _ in range(250):
        lp, slow = random_case(rng)
        best_parts, best_t = exhaustive(lp, slowdown=slow)
        if best_parts is None:
            with pytest.raises(BadInput, match="fits memory.capacity_mb"):
                partition(lp, slowdown=slow)
            continue
        checked += 1
        res = partition(lp, slowdown=slow)
        assert res.complete
        assert res.iteration_ms == pytest.approx(best_t, abs=1e-6), (lp, slow, best_parts, res)
        assert evaluate(lp, res.parts, slowdown=slow) == pytest.approx(res.iteration_ms, abs=1e-6)
        # The bound holds for every feasible partition of the scaled stage times under any plan.
        every = [max(lower_bound_ms(lp.costs(p, slow), lp.microbatches, caps=lp.caps(p)),
                     cap_bound_ms(lp.costs(p, slow), lp.microbatches, lp.caps(p)))
                 for p in compositions(lp.num_layers, lp.stages) if None not in lp.caps(p)]
        assert res.lower_bound_ms <= min(every) + 1e-9
    assert checked > 150


def test_factors_of_one_change_nothing():
    rng = random.Random(4)
    for _ in range(40):
        lp, _ = random_case(rng)
        if exhaustive(lp)[0] is None:
            continue
        plain, ones = partition(lp), partition(lp, slowdown=[1.0] * lp.stages)
        assert (plain.parts, plain.iteration_ms, plain.lower_bound_ms) == (ones.parts, ones.iteration_ms,
                                                                          ones.lower_bound_ms)


def test_hand_derived_a_slow_stage_gets_fewer_layers():
    # 4 equal layers (F = B = W = 1 ms), 2 stages, 4 micro-batches, free links; stage 0 runs 3x slower.
    lp = layer_profile(stages=2, microbatches=4,
                       layers={"forward_ms": [1] * 4, "backward_input_ms": 1, "backward_weight_ms": 1})
    slow = [3.0, 1.0]
    # [0, 1, 4]: stage 0 holds 1 layer at 3x (3 ms per op), stage 1 holds 3 layers (3 ms per op):
    # two equal stages of t = 3 ms, the even case: 3·N·t + (S−1)·t = 36 + 3 = 39 ms, which is also
    # stage 1's bound (F0 arrives at 3, then N·(f + b + w) = 36 of work).
    assert evaluate(lp, [0, 1, 4], slowdown=slow) == 39.0
    # [0, 2, 4]: stage 0 runs 6 ms per op, 4·18 = 72 ms of work from time 0; every gradient is back
    # 4 ms after its forward ends (2 + 2 on stage 1), within the op stage 0 runs next, so it never
    # idles: 72 ms. [0, 3, 4]: 4·27 = 108 ms on stage 0 at least.
    assert evaluate(lp, [0, 2, 4], slowdown=slow) == 72.0
    assert evaluate(lp, [0, 3, 4], slowdown=slow) >= 108.0
    res = partition(lp, slowdown=slow)
    assert res.parts == [0, 1, 4] and res.iteration_ms == 39.0 and res.lower_bound_ms == 39.0
    assert exhaustive(lp, slowdown=slow) == ([0, 1, 4], 39.0)
    # Without the factor the even cut wins (26 ms, test_partition.py); stage 1 slow mirrors it.
    assert partition(lp).parts == [0, 2, 4]
    assert partition(lp, slowdown=[1.0, 3.0]).parts == [0, 3, 4]


def test_costs_and_stage_profile_scale_stage_times_not_links():
    lp = layer_profile(stages=2, microbatches=4, links={"bandwidth_gbs": 2, "latency_ms": 1.5},
                       layers={"forward_ms": [1, 2, 3], "backward_input_ms": [2, 3, 4], "backward_weight_ms": 0.5,
                               "activation_mb": [10, 30, 5], "gradient_mb": [20, 50, 5]})
    c = lp.costs([0, 2, 3], [2.0, 0.5])
    # Stage 0: F 1 + 2 = 3, B 2 + 3 = 5, W 1, all x2; stage 1: F 3, B 4, W 0.5, all x0.5.
    assert (c.f, c.b, c.w) == ([6.0, 1.5], [10.0, 2.0], [2.0, 0.25])
    assert c.links == lp.costs([0, 2, 3]).links == [1.5 + (30 + 50) / 2 / 2]  # latency + mean transfer
    prof = lp.stage_profile([0, 2, 3], slowdown=[2.0, 0.5])
    assert prof.compute_ms.forward == [6.0, 1.5] and prof.links_ms == [21.5]
    assert evaluate(lp, [0, 2, 3], slowdown=[2.0, 0.5]) == quick_ms(c, 4, [4, 4])


def test_block_shifts_move_one_layer_between_two_stages():
    moves = {tuple(q) for q in block_shifts([0, 2, 4, 6])}
    # Boundaries 1..1, 2..2, 1..2 moved by -1 or +1, keeping every stage non-empty.
    assert moves == {(0, 1, 4, 6), (0, 3, 4, 6), (0, 2, 3, 6), (0, 2, 5, 6), (0, 1, 3, 6), (0, 3, 5, 6)}
    assert list(block_shifts([0, 1, 2])) == []
    assert list(block_shifts([0, 5])) == []


@pytest.mark.parametrize(
    "slowdown, match",
    [
        ([1.0], "slowdown: expected 2 factors (one per stage), got 1"),
        ([1.0, 1.0, 1.0], "slowdown: expected 2 factors (one per stage), got 3"),
        ([1.0, 0.0], "slowdown: stage 1's factor must be a finite number above 0, got 0.0"),
        ([-2, 1], "slowdown: stage 0's factor must be a finite number above 0, got -2"),
        ([1.0, math.nan], "stage 1's factor must be a finite number above 0, got nan"),
        ([math.inf, 1.0], "stage 0's factor must be a finite number above 0, got inf"),
        ([1.0, "2"], "stage 1's factor must be a finite number above 0, got '2'"),
        ([True, 1.0], "stage 0's factor must be a finite number above 0, got True"),
        ("12", "slowdown: expected a list of 2 factors"),
        (2.0, "slowdown: expected a list of 2 factors"),
    ],
)
def test_bad_slowdown_is_one_sentence(slowdown, match):
    lp = layer_profile(stages=2, microbatches=4,
                       layers={"forward_ms": [1, 1, 1], "backward_input_ms": 1, "backward_weight_ms": 1})
    for call in (lambda: partition(lp, slowdown=slowdown), lambda: evaluate(lp, [0, 1, 3], slowdown=slowdown),
                 lambda: exhaustive(lp, slowdown=slowdown), lambda: lp.costs([0, 1, 3], slowdown),
                 lambda: lp.stage_profile([0, 1, 3], slowdown), lambda: check_slowdown(slowdown, 2)):
        with pytest.raises(BadInput) as e:
            call()
        assert match in str(e.value) and "\n" not in str(e.value)


def test_exhaustive_takes_slowdown_for_its_own_objective_only():
    lp = layer_profile(stages=2, microbatches=2,
                       layers={"forward_ms": [1, 1, 1], "backward_input_ms": 1, "backward_weight_ms": 1})
    with pytest.raises(ValueError, match="slowdown applies to the default objective"):
        exhaustive(lp, objective=evaluate, slowdown=[1.0, 2.0])
