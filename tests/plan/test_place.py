"""The orchestrator's placement: link matrix, ring all-reduce cost, placement search, three predictions."""
import itertools
import math
import random

import pytest
from pydantic import ValidationError

from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.place.placement import Placement, TopologyFile, allreduce_ms, ring_links
from ds_pipemorph.plan.place.predict import Job, Planner, place, predict
from ds_pipemorph.plan.place.placement_search import best_placements

EVALS = 300  # planner search effort per planned pipeline: reached long before the time budget


def job(pp=4, n=12, grad_mb=100.0, chunk_mb=4.0, **kw):
    return Job(Costs.uniform(pp, 10.0), n, [grad_mb] * pp, chunk_mb=chunk_mb, **kw)


def split_matrix(world, slow, latency_ms=30.0):
    """Ranks in ``slow`` sit behind one slow link: every pair with one rank on each side is slow."""
    return LinkMatrix.model_validate({"world_size": world, "latency_ms": [
        [0.0 if (a in slow) == (b in slow) else latency_ms for b in range(world)] for a in range(world)]})


# --- ring all-reduce cost -------------------------------------------------------------------------

def ring_allreduce_by_steps(matrix, ranks, grad_mb, chunk_mb=None):
    """Run the ring algorithm on numbers (rank i starts with vector [i+1]*D, one entry per part)
    and time it bulk-synchronously: each step lasts as long as its slowest transfer, a transfer of
    s MB being ceil(s / chunk) messages (one in flight, each paying the latency) plus s / bandwidth."""
    ring = sorted(ranks)
    D = len(ring)
    data = {r: [float(i + 1)] * D for i, r in enumerate(ring)}
    part = grad_mb / D
    t = 0.0
    steps = 0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(D - 1):
            sends = []
            for i, r in enumerate(ring):
                # reduce-scatter: rank i sends part (i - step); all-gather: part (i + 1 - step)
                idx = (i - step) % D if phase == "reduce-scatter" else (i + 1 - step) % D
                sends.append((r, ring[(i + 1) % D], idx, data[r][idx]))
            for src, dst, idx, val in sends:
                data[dst][idx] = data[dst][idx] + val if phase == "reduce-scatter" else val
            msgs = math.ceil(part / chunk_mb) if chunk_mb else 1
            t += max(msgs * matrix.latency(s, d) + part / matrix.bandwidth(s, d) for s, d, _, _ in sends)
            steps += 1
    total = sum(range(1, D + 1))
    assert all(v == [total] * D for v in data.values()), "the ring did not all-reduce"
    assert steps == 2 * (D - 1)
    return t


def test_ring_allreduce_cost_matches_a_hand_derivation_and_a_step_by_step_ring():
    # Model: 2(D-1) steps; each step every rank sends G/D MB to its successor in ascending rank
    # order; a step lasts max over ring links of (k * latency + (G/D) / bandwidth).
    m = LinkMatrix.model_validate({
        "world_size": 4, "default": {"latency_ms": 1.0, "bandwidth_gbs": 100.0},
        "pairs": [{"ranks": [2, 1], "latency_ms": 0.5, "bandwidth_gbs": 10.0},
                  {"ranks": [0, 3], "latency_ms": 5.0}],
    })
    group = [3, 0, 2, 1]  # a group's ring follows ascending global rank
    assert ring_links(group) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    # G = 200 MB, D = 4: parts of 50 MB. Links: (0,1) 1 + 0.5, (1,2) 0.5 + 5, (2,3) 1 + 0.5,
    # (3,0) 5 + 0.5 -> a step is 5.5 ms, 6 steps: 33 ms.
    assert allreduce_ms(m, group, 200.0) == pytest.approx(33.0)
    assert ring_allreduce_by_steps(m, group, 200.0) == pytest.approx(33.0)
    # 8 MB messages: 7 per part. (3,0) 7 * 5 + 0.5 = 35.5 ms a step, 6 steps: 213 ms.
    assert allreduce_ms(m, group, 200.0, chunk_mb=8.0) == pytest.approx(213.0)
    assert ring_allreduce_by_steps(m, group, 200.0, chunk_mb=8.0) == pytest.approx(213.0)
    # Two ranks: one link used both ways, 2 steps of G/2: G / bw + 2 latency.
    assert allreduce_ms(m, [1, 2], 200.0) == pytest.approx(2 * (0.5 + 100 / 10))
    assert allreduce_ms(m, [3], 200.0) == 0.0 and allreduce_ms(m, [0, 1], 0.0) == 0.0
    rng = random.Random(3)
    for _ in range(20):
        W = rng.randint(2, 7)
        m = LinkMatrix.model_validate({"world_size": W, "pairs": [
            {"ranks": [a, b], "latency_ms": rng.uniform(0, 20), "bandwidth_gbs": rng.uniform(1, 100)}
            for a, b in itertools.combinations(range(W), 2)]})
        group = rng.sample(range(W), rng.randint(1, W))
        g, chunk = rng.uniform(1, 500), rng.choice([None, 1.0, 7.5])
        assert allreduce_ms(m, group, g, chunk_mb=chunk) == pytest.approx(ring_allreduce_by_steps(m, group, g, chunk))


# --- the link matrix and the topology file --------------------------------------------------------

def test_link_matrix_forms_and_bad_input():
    m = LinkMatrix.model_validate({"world_size": 3, "latency_ms": [[0, 1, 2], [1, 0, 3], [2, 3, 0]],
                                   "pairs": [{"ranks": [2, 0], "bandwidth_gbs": 5}]})
    assert (m.latency(0, 2), m.latency(2, 1), m.bandwidth(0, 2), m.bandwidth(2, 0), m.bandwidth(0, 1)) == (2, 3, 5, 5, 100)
    bad = [
        ({"world_size": 3, "latency_ms": [[0, 1], [1, 0]]}, "expected a 3 x 3 matrix"),
        ({"world_size": 2, "latency_ms": [[0, 1], [2, 0]]}, "not symmetric"),
        ({"world_size": 2, "latency_ms": [[0, -1], [-1, 0]]}, "must be a number >= 0"),
        ({"world_size": 2, "bandwidth_gbs": [[0, 0], [0, 0]]}, "must be a positive number"),
        ({"world_size": 2, "pairs": [{"ranks": [0, 2], "latency_ms": 1}]}, "outside 0..1"),
        ({"world_size": 2, "pairs": [{"ranks": [0, 1], "latency_ms": -1}]}, "greater than or equal to 0"),
        ({"world_size": 2, "pairs": [{"ranks": [0, 1]}, {"ranks": [1, 0]}]}, "listed twice"),
    ]
    for data, needle in bad:
        with pytest.raises(ValidationError, match=needle):
            LinkMatrix.model_validate(data)


def test_topology_file_checks_the_grid():
    assert TopologyFile.model_validate({"dims": [2, 2], "ranks": [[0, 3], [2, 1]]}).placement().pipeline(1) == [3, 1]
    for data, needle in [({"dims": [2, 2], "ranks": [[0, 1], [2, 2]]}, "rank 3 is missing"),
                         ({"dims": [2, 2], "ranks": [[0, 1, 2, 3]]}, "expected 2 rows"),
                         ({"dims": [2, 2], "ranks": [[0, 1], [2, 3]], "axes": ["data", "pipe"]}, "pipe")]:
        with pytest.raises(ValidationError, match=needle):
            TopologyFile.model_validate(data)


# --- placements -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pp,dp,exact", [(2, 2, None), (4, 2, None), (2, 3, None), (4, 4, False)])
def test_a_matrix_without_a_slow_pair_gives_deepspeeds_default(pp, dp, exact):
    for m in (LinkMatrix.uniform(pp * dp), LinkMatrix.uniform(pp * dp, latency_ms=5.0, bandwidth_gbs=10.0)):
        r = place(m, pp, dp, job(pp), max_evals=EVALS, exact=exact, search_budget_s=20)
        default = Placement.default(pp, dp)
        assert default.grid[1] == tuple(dp + x for x in range(dp))  # rank = stage * D + replica
        assert r.baseline.placement == r.replacement.placement == r.orchestrator.placement == default
        assert r.orchestrator.iteration_ms <= r.replacement.iteration_ms == r.baseline.iteration_ms


def test_default_placement_is_deepspeeds_pipe_data_parallel_topology():
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    for pp, dp in [(1, 1), (4, 2), (2, 4), (3, 3)]:
        ds = topology.PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        grid = Placement.default(pp, dp).grid
        assert all(ds.get_rank(pipe=s, data=r) == grid[s][r] for s in range(pp) for r in range(dp))
        assert ds.get_axis_comm_lists("data") == [list(row) for row in grid]  # DP groups = stages' rows


def test_a_single_slow_pair_leaves_every_ring_and_carries_no_traffic():
    # Ranks 0 and 1 hold stage 0 of both replicas by default: the slow pair is a DP ring.
    m = LinkMatrix.uniform(8, pairs=[{"ranks": [0, 1], "latency_ms": 30}])
    r = place(m, 4, 2, job(), max_evals=EVALS)
    base = r.baseline
    assert base.allreduce_ms[0] > 100 * base.allreduce_ms[1]
    uniform = predict(Placement.default(4, 2), LinkMatrix.uniform(8), Planner(job(), "static")).iteration_ms
    for pred in (r.replacement, r.orchestrator):
        p = pred.placement
        pos = {x: (s, rep) for s in range(4) for rep, x in enumerate(p.grid[s])}
        (s0, r0), (s1, r1) = pos[0], pos[1]
        assert s0 != s1  # not in one ring
        assert not (r0 == r1 and abs(s0 - s1) == 1)  # nor neighbours in one pipeline: an unused pair
        assert pred.iteration_ms == pytest.approx(uniform)


def test_a_slow_host_in_dp_rings_moves_onto_a_pipeline_link_at_the_first_stage():
    # Ranks 1 and 3 sit behind a slow link; by default they share rings with 0 and 2. Some traffic
    # must cross the slow link; the best is one stage's ring inside the slow side, so the slow link
    # carries one pipeline link per replica. The model puts it at the first stage (link 0):
    # the static ZB order loses less there than at the last stage, the planned order nothing more.
    m = split_matrix(8, {1, 3})
    for direct in (False, True):
        j = job(direct=direct)
        r = place(m, 4, 2, j, max_evals=EVALS)
        assert r.baseline.allreduce_ms[0] > 100 and r.baseline.allreduce_ms[1] > 100
        for pred in (r.replacement, r.orchestrator):
            grid = pred.placement.grid
            assert set(grid[0]) == {1, 3}
            assert max(pred.allreduce_ms) < 2
            assert [row[0] for row in pred.links_ms] == [30.0, 30.0] and all(v[1:] == [0.0, 0.0] for v in pred.links_ms)
        # every stage that could hold the slow ring, predicted: the first is best for both ways
        planners = {k: Planner(j, k, budget_s=1.0, max_evals=EVALS) for k in ("static", "full")}
        at = {}
        for stage in range(4):
            rest = iter([0, 2, 4, 5, 6, 7])
            grid = [[1, 3] if s == stage else [next(rest), next(rest)] for s in range(4)]
            at[stage] = {k: predict(Placement.from_ranks(grid), m, pl).iteration_ms for k, pl in planners.items()}
        assert min(at, key=lambda s: (at[s]["static"], s)) == 0
        assert r.replacement.iteration_ms == pytest.approx(at[0]["static"])
        assert r.orchestrator.iteration_ms == pytest.approx(min(v["full"] for v in at.values()))
        assert at[0]["static"] < at[3]["static"] < at[1]["static"]


@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 2), (2, 3)])
def test_exact_search_equals_brute_force_over_all_placements(pp, dp):
    rng = random.Random(pp * 10 + dp)
    W = pp * dp
    m = LinkMatrix.model_validate({"world_size": W, "pairs": [
        {"ranks": [a, b], "latency_ms": rng.choice([0, 0, 0, 5, 20, 40]), "bandwidth_gbs": rng.choice([10, 100])}
        for a, b in itertools.combinations(range(W), 2)]})
    for kind in ("static", "quick"):
        planner = Planner(job(pp, n=2 * pp), kind)
        objective = lambda p: predict(p, m, planner).iteration_ms  # noqa: E731
        brute = min(objective(Placement(tuple(tuple(perm[s * dp:(s + 1) * dp]) for s in range(pp))))
                    for perm in itertools.permutations(range(W)))
        (best, t), = best_placements(pp, dp, objective, exact=True)
        assert t == pytest.approx(brute) and objective(best) == pytest.approx(brute)
        (_, t_swap), = best_placements(pp, dp, objective, exact=False, budget_s=20)
        assert t_swap >= t - 1e-9


def test_orchestrator_beats_replacement_beats_baseline_on_a_slow_dp_link():
    # Two groups of four ranks joined by a 30 ms link; by default every ring crosses it.
    m = split_matrix(8, {1, 3, 5, 7})
    for direct in (False, True):
        r = place(m, 4, 2, job(direct=direct), max_evals=EVALS)
        b, rp, o = r.baseline.iteration_ms, r.replacement.iteration_ms, r.orchestrator.iteration_ms
        assert o < rp < b
        assert r.exact
        assert all(a < 2 for a in r.orchestrator.allreduce_ms)  # rings inside a group
        assert r.orchestrator.planned_links_ms == [0.0, 30.0, 0.0]  # the slow link is pipeline link 1
        ratios = r.ratios()
        assert ratios["orchestrator_vs_baseline"] == pytest.approx(ratios["replacement_vs_baseline"] * ratios["orchestrator_vs_replacement"])
    assert r.orchestrator.link_model == "delegated(2)" and r.replacement.link_model == "direct"


def test_placement_is_deterministic_and_swap_search_agrees_on_the_split_case():
    m = split_matrix(8, {1, 3, 5, 7})
    runs = [place(m, 4, 2, job(), max_evals=EVALS) for _ in range(2)]
    runs.append(place(m, 4, 2, job(), max_evals=EVALS, exact=False, search_budget_s=20))
    keys = [[(p.placement.grid, p.iteration_ms, p.schedule) for p in (x.baseline, x.replacement, x.orchestrator)] for x in runs]
    assert keys[0] == keys[1]
    assert [k[1] for k in keys[2]] == [k[1] for k in keys[0]]  # the same times by swap local search


def test_bad_shapes_are_one_sentence_value_errors():
    m = LinkMatrix.uniform(8)
    with pytest.raises(ValueError, match="3 stages x 2 replicas is 6 ranks but the link matrix is for 8 ranks"):
        place(m, 3, 2, job(3))
    with pytest.raises(ValueError, match="op times are for 4 stages but --pp is 2"):
        place(m, 2, 4, job(4))
    with pytest.raises(ValueError, match="expected 4 values"):
        place(m, 4, 2, Job(Costs.uniform(4), 12, [1.0, 2.0]))
