"""When the orchestrator (``control.orchestrate.Orchestrator``) sees a data-parallel straggler: a
stage's all-reduce must stand out against what the best ring would take *on this machine*, the ring
model plus the fixed cost the other stages' all-reduces show, as on a real network (the lab run of
``benchmarks/lab/lab_orchestrator.py``: gloo's all-reduces of 2 MB over fast pairs took 15-35 ms where
the model says 3-5 ms)."""
from ds_pipemorph.control.orchestrate import Orchestrator
from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
from ds_pipemorph.plan.place.placement import Placement

FBW = [[10.0, 10.0, 10.0]] * 2
GRAD_MB = [2.0, 2.0]


def matrix() -> LinkMatrix:
    """4 ranks, 1 GB/s everywhere, ranks 0 and 1 (stage 0's ring on the default placement) at 100 Mbit/s."""
    return LinkMatrix.uniform(4, latency_ms=0.1, bandwidth_gbs=1.0,
                              pairs=[{"ranks": [0, 1], "bandwidth_gbs": 0.0125}])


def orchestrator() -> Orchestrator:
    return Orchestrator(matrix(), Placement.default(2, 2), 8, GRAD_MB)


def test_a_stage_whose_measured_all_reduce_stands_out_is_moved_out_of_the_slow_ring():
    o = orchestrator()
    assert o.in_force_ms()[0] > 150 and o.in_force_ms()[1] < 3  # the model: stage 0's ring crosses the slow pair
    decisions = [o.observe(ar, FBW) for ar in ([300.0, 40.0], [190.0, 25.0], [185.0, 30.0])]
    assert decisions[:2] == [None, None]  # the first iteration is start-up; patience 2
    d = decisions[2]
    assert d is not None and d.iteration == 2
    assert not any({0, 1} <= set(ring) for ring in d.ranks), d.ranks
    assert abs(d.overhead_ms - (30.0 - o.in_force_ms()[1])) < 1e-9  # read from stage 1, the good ring
    assert d.predicted_ms < d.current_ms and d.seconds > 0


def test_a_matrix_that_calls_a_link_slow_which_measures_fast_triggers_nothing():
    # Every all-reduce pays ~25 ms on this machine; stage 0's is no slower than stage 1's. The ring
    # model alone (a floor of ~2 ms) would call both stages stragglers and re-map for nothing.
    o = orchestrator()
    for ar in ([60.0, 50.0], [27.0, 25.0], [28.0, 24.0], [26.0, 27.0], [29.0, 25.0]):
        assert o.observe(ar, FBW) is None
    assert not o.decisions and not o.done
    assert 20.0 < o.overheads[-1] < 30.0


def test_settled_only_once_measured_with_every_stage_within_its_noise_or_after_acting():
    # The boundary lets exchanges grow apart while the orchestrator is settled (control.exchange).
    o = orchestrator()
    settled = []
    for ar in ([60.0, 50.0], [27.0, 25.0], [28.0, 24.0], [190.0, 25.0], [26.0, 27.0]):
        o.observe(ar, FBW)
        settled.append(o.settled)
    # start-up, then one iteration before the floor is known; a slow stage 0 at the 4th, calm again at the 5th
    assert settled == [False, False, True, False, True]
    o = orchestrator()
    for ar in ([300.0, 40.0], [190.0, 25.0], [185.0, 30.0]):
        o.observe(ar, FBW)
    assert o.done and o.settled  # acted: not again for this matrix


def test_without_a_stage_on_a_good_ring_the_fixed_cost_is_zero_and_the_model_decides():
    # Every ring crosses the slow half (the injected benchmark's case): no stage shows the fixed cost.
    m = LinkMatrix.uniform(4, latency_ms=0.1, bandwidth_gbs=1.0,
                           pairs=[{"ranks": [0, 1], "bandwidth_gbs": 0.0125}, {"ranks": [2, 3], "bandwidth_gbs": 0.0125}])
    o = Orchestrator(m, Placement.default(2, 2), 8, GRAD_MB)
    out = [o.observe(ar, FBW) for ar in ([200.0, 200.0], [170.0, 165.0], [168.0, 171.0])]
    assert out[2] is not None and out[2].overhead_ms == 0.0
    assert not any(set(pair) <= set(ring) for ring in out[2].ranks for pair in ((0, 1), (2, 3)))


def test_the_deciding_iteration_searches_placements_once():
    o = orchestrator()
    calls = []
    place = o._place

    def counted(stage_ms):
        calls.append(o.iteration)
        return place(stage_ms)

    o._place = counted
    for ar in ([300.0, 40.0], [190.0, 25.0], [185.0, 30.0]):
        o.observe(ar, FBW)
    assert o.decisions and calls == [3]  # once, at the deciding iteration (the floor and the answer)


def test_place_without_the_replacement_search_gives_the_same_orchestrator_placement():
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.place.predict import Job, place

    m = LinkMatrix.uniform(8, latency_ms=0.1, bandwidth_gbs=1.0, pairs=[{"ranks": [2, 3], "bandwidth_gbs": 0.0125},
                                                                         {"ranks": [0, 5], "latency_ms": 3.0}])
    job = Job(Costs.uniform(4, 10.0), 8, [2.0] * 4)
    full, quick = place(m, 4, 2, job, max_evals=50), place(m, 4, 2, job, max_evals=50, replacement=False)
    assert quick.replacement is None and full.replacement is not None
    assert quick.orchestrator.placement == full.orchestrator.placement
    assert quick.orchestrator.iteration_ms == full.orchestrator.iteration_ms
    assert quick.baseline.iteration_ms == full.baseline.iteration_ms


def test_detection_on_every_process_and_a_search_on_one_reach_observes_decisions_and_state():
    # The engine runs ``due`` on every rank and ``search`` on rank 0 only, which the others ``adopt``:
    # the same decisions and ``settled`` as one process running ``observe``, and a search only at the
    # first ``patience`` iterations kept (the floor) and where a stage is slow ``patience`` times in a row.
    ref, searcher, follower = orchestrator(), orchestrator(), orchestrator()

    def no_search(stage_ms):
        raise AssertionError("a process that adopts never places")

    follower._place = no_search
    dues, decided = [], []
    for ar in ([60.0, 50.0], [27.0, 25.0], [28.0, 24.0], [190.0, 25.0], [185.0, 27.0], [26.0, 27.0]):
        want = ref.observe(ar, FBW)
        due = searcher.due(ar)
        assert follower.due(ar) == due
        got = searcher.search(FBW) if due else None
        if due:
            follower.adopt(*searcher.searched())
        assert (got is None) == (want is None)
        if got is not None:
            assert (got.ranks, got.iteration, got.predicted_ms) == (want.ranks, want.iteration, want.predicted_ms)
            decided.append(got.iteration)
        assert follower.settled == searcher.settled == ref.settled
        assert follower.done == searcher.done == ref.done and follower.overheads == searcher.overheads
        dues.append(due)
    # start-up; one iteration kept; the floor planned at the second (nothing slow); stage 0 slow once,
    # then twice in a row (the decision); acted, so nothing is due after it
    assert dues == [False, False, True, False, True, False]
    assert decided == [4]
