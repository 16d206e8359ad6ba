"""Partitioning (``plan.partition``, ``plan.partition.layer_profile``, ``plan.partition.parts``): the branch and bound
equals exhaustive search of the same objective, memory limits are kept, hand-derived cases, the
baselines equal DeepSpeed's own partition methods, and bad input is one sentence."""
import random

import pytest
from layer_cases import random_layer_data
import yaml

from ds_pipemorph.fileio import BadInput, load_model
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.partition.layer_profile import LayerProfile, read_layer_profile
from ds_pipemorph.plan.partition.partition import compositions, evaluate, exhaustive, partition, quick_ms
from ds_pipemorph.plan.partition.parts import PartsFile, balanced_parts, check_parts, read_parts, uniform_parts
from ds_pipemorph.plan.sched.bounds import cap_bound_ms, lower_bound_ms


def layer_profile(**kw) -> LayerProfile:
    return LayerProfile.model_validate(kw)


def random_profile(rng: random.Random) -> LayerProfile:
    """Up to 10 layers, 4 stages, 10 micro-batches: integer-ish times (ties happen), boundary sizes
    from free to slow, and memory from unlimited to tight enough that some cuts do not fit."""
    return LayerProfile.model_validate(random_layer_data(rng, capacity_p=0.5))


def test_branch_and_bound_equals_exhaustive_search_on_small_random_cases():
    rng = random.Random(7)
    feasible = infeasible = 0
    for _ in range(250):
        lp = random_profile(rng)
        best_parts, best_t = exhaustive(lp)
        if best_parts is None:
            infeasible += 1
            with pytest.raises(BadInput, match="fits memory.capacity_mb"):
                partition(lp)
            continue
        feasible += 1
        res = partition(lp)
        assert res.complete
        # Same objective value (ties may pick another partition), and the value is the partition's.
        assert res.iteration_ms == pytest.approx(best_t, abs=1e-6), (lp, best_parts, res)
        assert evaluate(lp, res.parts) == pytest.approx(res.iteration_ms, abs=1e-6)
        assert all(c is not None for c in lp.caps(res.parts))
        # The bound is below every feasible partition under every plan, so below the optimum.
        assert res.lower_bound_ms <= best_t + 1e-9
        every = [max(lower_bound_ms(lp.costs(p), lp.microbatches, caps=lp.caps(p)),
                     cap_bound_ms(lp.costs(p), lp.microbatches, lp.caps(p)))
                 for p in compositions(lp.num_layers, lp.stages) if None not in lp.caps(p)]
        assert res.lower_bound_ms <= min(every) + 1e-9
    assert feasible > 150 and infeasible > 5  # both kinds were exercised


def test_a_time_limit_returns_a_feasible_partition_and_a_valid_bound():
    rng = random.Random(3)
    f = [rng.uniform(1, 5) for _ in range(14)]
    lp = layer_profile(stages=4, microbatches=4, layers={"forward_ms": f, "backward_input_ms": f, "backward_weight_ms": 1,
                                                         "activation_mb": 20}, links={"bandwidth_gbs": 2})
    _, best_t = exhaustive(lp)
    res = partition(lp, time_limit_s=0.0)
    assert evaluate(lp, res.parts) == pytest.approx(res.iteration_ms)
    assert res.lower_bound_ms <= best_t + 1e-9 <= res.iteration_ms + 2e-9
    full = partition(lp)
    assert full.complete and full.iteration_ms == pytest.approx(best_t)


def test_memory_rules_out_cuts_and_sets_caps():
    # 4 layers of 100 MB static and 10 MB per in-flight micro-batch; 250 MB per stage: a stage holds
    # at most 2 layers, with (250 - 200) // 20 = 2 micro-batches in flight (1 layer: 15).
    lp = layer_profile(stages=2, microbatches=8,
                       layers={"forward_ms": [1, 1, 1, 1], "backward_input_ms": 1, "backward_weight_ms": 1,
                               "memory_mb": 100, "stash_mb": 10},
                       memory={"capacity_mb": 250})
    assert lp.caps([0, 1, 4]) == [8, None] and lp.caps([0, 3, 4]) == [None, 8]
    assert lp.caps([0, 2, 4]) == [2, 2]
    res = partition(lp)
    assert res.parts == [0, 2, 4]
    assert exhaustive(lp)[0] == [0, 2, 4]
    assert lp.stage_profile([0, 2, 4]).caps() == [2, 2]
    assert lp.stage_memory_mb([0, 2, 4]) == [240.0, 240.0]
    with pytest.raises(BadInput, match=r"stage 1 \(layers 1..3\) does not fit memory.capacity_mb"):
        lp.stage_profile([0, 1, 4])
    # No cut fits: one sentence naming what to change.
    tight = layer_profile(stages=2, microbatches=8, layers=dict(lp.layers.model_dump(), memory_mb=200),
                          memory={"capacity_mb": 250})
    with pytest.raises(BadInput) as e:
        partition(tight)
    assert "\n" not in str(e.value) and "memory.capacity_mb" in str(e.value)
    assert exhaustive(tight) == (None, float("inf"))


def test_hand_derived_a_slow_boundary_moves_the_cut():
    # 4 equal layers (F = B = W = 1 ms), 2 stages, 4 micro-batches.
    def lp(activation):
        return layer_profile(stages=2, microbatches=4, links={"bandwidth_gbs": 1},
                             layers={"forward_ms": [1] * 4, "backward_input_ms": 1, "backward_weight_ms": 1,
                                     "activation_mb": activation})

    # Free boundaries: the even cut, 3·N·t + (S−1)·t with t = 2 ms per op: 26 ms.
    even = lp(0)
    res = partition(even)
    assert res.parts == [0, 2, 4] and res.iteration_ms == 26.0 and res.lower_bound_ms == 26.0
    # A 200 MB boundary after layer 1 (at 1 GB/s: 200 ms each way). Cutting there costs
    # F0 on stage 0 (2) + 200 + F0, B0 on stage 1 (4) + 200 + N (B + W) on stage 0 (16) = 422 ms;
    # [0, 1, 4]: stage 1 works N·9 = 36 ms without a gap from F0's arrival at 1 ms: 37 ms;
    # [0, 3, 4]: stage 0 works 36 ms without a gap from 0: 36 ms, the best.
    slow = lp([0, 200, 0, 0])
    assert slow.costs([0, 2, 4]).links == [200.0]
    assert evaluate(slow, [0, 2, 4]) == 422.0
    assert evaluate(slow, [0, 1, 4]) == 37.0
    res = partition(slow)
    assert res.parts == [0, 3, 4] and res.iteration_ms == 36.0 and res.lower_bound_ms == 36.0


def test_cap_bound_by_hand_and_never_above_a_schedule_or_the_milp_optimum():
    # 2 stages, F = B = W = 1 ms, a 10 ms link, one micro-batch in flight per stage: each of the
    # 4 micro-batches goes down and back alone (1 + 10 + 1 + 1 + 10 + 1 = 24 ms), then the last W:
    # 97 ms. The planner's bound counts one round trip only.
    c = Costs([1, 1], [1, 1], [1, 1], [10])
    assert cap_bound_ms(c, 4, [1, 1]) == 97.0 == quick_ms(c, 4, [1, 1])
    assert lower_bound_ms(c, 4, caps=[1, 1]) < 97.0
    rng = random.Random(5)
    for _ in range(400):
        S, N = rng.randint(1, 5), rng.randint(1, 10)
        c = Costs([rng.choice([0, 1, 2, 3.5]) for _ in range(S)], [rng.choice([0, 1, 2, 4]) for _ in range(S)],
                  [rng.choice([0, 1, 2]) for _ in range(S)], [rng.choice([0, 0, 1, 5, 20]) for _ in range(S - 1)])
        caps = [rng.randint(1, N) for _ in range(S)]
        assert cap_bound_ms(c, N, caps) <= quick_ms(c, N, caps) + 1e-9, (c, N, caps)
    pytest.importorskip("highspy")
    from ds_pipemorph.plan.sched.milp import solve_exact

    proven = 0
    for _ in range(12):
        S, N = rng.randint(2, 3), rng.randint(2, 5)
        c = Costs([rng.choice([1, 2, 3]) for _ in range(S)], [rng.choice([1, 2, 4]) for _ in range(S)],
                  [rng.choice([0, 1, 2]) for _ in range(S)], [rng.choice([0, 1, 5, 20]) for _ in range(S - 1)])
        caps = [rng.randint(1, N) for _ in range(S)]
        res = solve_exact(c, N, caps=caps, time_limit_s=20.0)
        if res.optimal:
            proven += 1
            assert cap_bound_ms(c, N, caps) <= res.iteration_ms + 1e-6, (c, N, caps)
    assert proven >= 8


def test_stage_profile_sums_by_hand():
    lp = layer_profile(
        stages=2, microbatches=6,
        layers={"forward_ms": [1, 2, 3], "backward_input_ms": [2, 3, 4], "backward_weight_ms": 0.5,
                "activation_mb": [10, 30, 5], "gradient_mb": [20, 50, 5], "memory_mb": [100, 200, 300],
                "stash_mb": [4, 6, 10]},
        links={"bandwidth_gbs": 2, "latency_ms": 1.5},
        memory={"capacity_mb": [400, 400]},
    )
    prof = lp.stage_profile([0, 2, 3])
    c = prof.compute_ms
    assert c.forward == [3.0, 3.0] and c.backward_input == [5.0, 4.0] and c.backward_weight == [1.0, 0.5]
    # Boundary after layer 1: 1.5 ms latency + mean of 30 MB down and 50 MB up at 2 GB/s = 1.5 + 20.
    assert prof.links_ms == [21.5]
    # Stage 0: (400 - 300) // (4 + 6) = 10, above N = 6; stage 1: (400 - 300) // 10 = 10 -> 6.
    assert prof.caps() == [6, 6] and prof.memory is None
    assert lp.stage_memory_mb([0, 2, 3]) == [300 + 6 * 10.0, 300 + 6 * 10.0]
    capped = layer_profile(**dict(lp.model_dump(), memory={"capacity_mb": [400, 340]}))
    assert capped.stage_profile([0, 2, 3]).memory.max_inflight == [6, 4]  # (340 - 300) // 10 = 4


def test_uniform_and_balanced_parts_equal_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    for n in range(0, 20):
        for m in range(1, 9):
            assert uniform_parts(n, m) == list(partition_uniform(n, m)), (n, m)
    rng = random.Random(11)
    for _ in range(300):
        n, m = rng.randint(1, 14), rng.randint(1, 6)
        kind = rng.random()
        if kind < 0.4:
            w = [rng.randint(0, 1000) for _ in range(n)]
        elif kind < 0.7:
            w = [rng.choice([0, 1]) for _ in range(n)]  # partition_method="type:..."
        else:
            w = [rng.uniform(0, 10) for _ in range(n)]
        assert balanced_parts(w, m) == [int(x) for x in partition_balanced(w, m)], (w, m)


def test_parts_file_round_trip_and_checks(tmp_path):
    p = tmp_path / "parts.yaml"
    p.write_text(yaml.safe_dump({"version": 1, "parts": [0, 3, 7, 8], "links_ms": [1.0, 2.0]}))
    assert read_parts(p, layers=8, stages=3).parts == [0, 3, 7, 8]
    for layers, stages, match in ((9, 3, "the model has 9 layers"), (8, 4, "3 stages, but the pipeline has 4")):
        with pytest.raises(BadInput, match=match) as e:
            read_parts(p, layers=layers, stages=stages)
        assert "\n" not in str(e.value)
    p.write_text(yaml.safe_dump({"parts": [0, 3, 3, 8]}))
    with pytest.raises(BadInput, match="stage 1 is empty"):
        load_model(p, PartsFile)
    p.write_text(yaml.safe_dump({"parts": [0, 3, 8], "links_ms": [1.0, 2.0]}))
    with pytest.raises(BadInput, match="links_ms: expected 1 values"):
        read_parts(p)


GOOD = {"stages": 2, "microbatches": 4, "layers": {"forward_ms": [1, 1, 1], "backward_input_ms": 1, "backward_weight_ms": 1}}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layers": dict(GOOD["layers"], forward_ms=[1])}, "1 layers cannot fill 2 stages"),
        ({"layers": dict(GOOD["layers"], backward_input_ms=[1, 1])}, "layers.backward_input_ms: expected 3 values"),
        ({"layers": dict(GOOD["layers"], forward_ms=[1, -2, 1])}, "layers.forward_ms: layer 1 is negative"),
        ({"layers": dict(GOOD["layers"], stash_mb=-1)}, "layers.stash_mb: layer 0 is negative"),
        ({"layers": dict(GOOD["layers"], forward_ms=[1, float("nan"), 1])}, "finite number"),
        ({"links": {"bandwidth_gbs": 0}}, "links.bandwidth_gbs: link 0 must be positive"),
        ({"links": {"latency_ms": [-1]}}, "links.latency_ms: link 0 is negative"),
        ({"links": {"latency_ms": [1, 2]}}, "links.latency_ms: expected 1 values"),
        ({"memory": {"capacity_mb": 0}}, "memory.capacity_mb: stage 0 must be positive"),
        ({"memory": {"max_inflight": [0, 1]}}, "memory.max_inflight: stage 0 must hold at least 1"),
        ({"microbatches": 0}, "microbatches"),
        ({"stages": 0}, "stages"),
        ({"layers": dict(GOOD["layers"], speed=1)}, "unknown key 'layers.speed'"),
        ({"layers": None}, "layers"),
    ],
)
def test_bad_layer_profiles_are_one_sentence(tmp_path, change, match):
    p = tmp_path / "lp.yaml"
    p.write_text(yaml.safe_dump(dict(GOOD, **change)))
    with pytest.raises(BadInput, match=match) as e:
        read_layer_profile(p)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(p))


def test_a_stage_profile_is_not_a_layer_profile(tmp_path):
    p = tmp_path / "profile.yaml"
    p.write_text(yaml.safe_dump({"stages": 2, "microbatches": 4,
                                 "compute_ms": {"forward": 1, "backward_input": 1, "backward_weight": 1}}))
    msg = "is a profile, not a layer profile: partitioning needs per-layer times under 'layers'"
    with pytest.raises(BadInput, match=msg) as e:
        read_layer_profile(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "parts, match",
    [([0, 2], "1 stages, but the pipeline has 2"), ([0, 1, 2], "ends at 2 but the model has 3 layers"),
     ([1, 2, 3], "must start at 0"), ([0, 2, 2, 3], "stage 1 is empty"), ([0], "at least 2 values")],
)
def test_parts_that_do_not_cover_the_layers_are_one_sentence(parts, match):
    lp = LayerProfile.model_validate(GOOD)
    with pytest.raises(BadInput, match=match) as e:
        lp.stage_profile(parts)
    assert "\n" not in str(e.value)
    with pytest.raises(BadInput):
        check_parts(parts, layers=3, stages=2)
