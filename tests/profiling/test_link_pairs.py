"""Pure parts of `profile-links --all-pairs`: the round-robin schedule, --inject-pairs-ms, and the
link matrix written from a report (symmetric: one latency per pair, the slower direction's bandwidth)."""
import itertools

import pytest
import yaml

from ds_pipemorph.fileio import BadInput, dump
from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
from ds_pipemorph.profiling.linkreport import build_pair_report, link_matrix
from ds_pipemorph.profiling.pairs import check_pair_ranks, parse_pair_delays, partner, round_robin


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world", range(2, 10))
def test_round_robin_meets_every_pair_once_in_rounds_of_disjoint_pairs(world):
    rounds = round_robin(world)
    assert len(rounds) == (world - 1 if world % 2 == 0 else world)
    seen = []
    for pairs in rounds:
        assert len(pairs) == world // 2
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks)), pairs  # disjoint: no rank twice in one round
        assert all(0 <= a < b < world for a, b in pairs)
        seen += pairs
    assert sorted(seen) == list(itertools.combinations(range(world), 2))  # every pair exactly once
    if world % 2:  # odd: each rank sits out exactly one round
        out = [set(range(world)) - {r for p in pairs for r in p} for pairs in rounds]
        assert sorted(r for s in out for r in s) == list(range(world))
    assert partner(rounds[0], rounds[0][0][1]) == rounds[0][0]
    assert round_robin(world) == rounds  # deterministic


@pytest.mark.timeout(10)
def test_round_robin_of_one_rank_is_empty():
    assert round_robin(1) == []


@pytest.mark.timeout(10)
def test_inject_pairs_parse_either_way_round():
    assert parse_pair_delays(None) is None
    assert parse_pair_delays(" 0-2:30, 3-1:2.5 ,") == {(0, 2): 30.0, (1, 3): 2.5}
    check_pair_ranks({(0, 2): 30.0, (1, 3): 2.5}, 4)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text,needle", [
    ("0-2", "'0-2' is not RANK-RANK:MS"),
    ("0:2:30", "'0:2:30' is not RANK-RANK:MS"),
    ("0-2:x", "'0-2:x' is not RANK-RANK:MS"),
    ("0-2:1.2.3", "'0-2:1.2.3' is not RANK-RANK:MS"),
    ("a-b:30", "is not RANK-RANK:MS"),
    ("0-2:-5", "has a delay of -5.0 ms"),
    ("1-1:30", "joins rank 1 with itself"),
    ("0-2:30,2-0:5", "the pair 0-2 is given twice"),
    (",", "names no pair"),
])
def test_inject_pairs_bad_forms(text, needle):
    with pytest.raises(BadInput) as e:
        parse_pair_delays(text)
    assert needle in str(e.value) and str(e.value).startswith("--inject-pairs-ms: ")


@pytest.mark.timeout(10)
def test_inject_pairs_outside_the_world():
    with pytest.raises(BadInput, match=r"rank 4 of the pair 0-4 is outside 0\.\.3 \(this job has 4 ranks\)"):
        check_pair_ranks({(0, 4): 30.0}, 4)


def _rec(lat, down_gbps, up_gbps, sizes):
    """Samples of one pair: one-way times lat + s / bandwidth (None: no size dependence)."""
    def times(bw):
        return {s: [lat + (0.0 if bw is None else s / (bw * 1e6))] * 3 for s in sizes}
    return {"latency_ms": [lat] * 6, "down": times(down_gbps), "up": times(up_gbps)}


@pytest.mark.timeout(10)
def test_link_matrix_is_symmetric_with_the_slower_direction_and_validates():
    sizes = [4096, 262144, 4194304]
    samples = {
        (0, 1): _rec(0.1, 4.0, 2.0, sizes),
        (0, 2): _rec(30.0, 3.0, 3.0, sizes),
        (1, 2): _rec(0.2, None, None, sizes),  # no bandwidth visible: the median of the measured pairs
    }
    rep = build_pair_report(samples, sizes, world=3, rounds=round_robin(3), slow_factor=2.0, backend="gloo",
                            hosts=["h"] * 3, warmup=1, reps=3, inject_ms={(0, 2): 30.0})
    assert [e["ranks"] for e in rep["pairs"]] == [[0, 1], [0, 2], [1, 2]]
    assert [e["slow"] != "" for e in rep["pairs"]] == [False, True, False]
    assert rep["inject_pairs_ms"] == [{"ranks": [0, 2], "delay_ms": 30.0}]
    data = link_matrix(rep)
    assert list(data) == ["version", "world_size", "latency_ms", "bandwidth_gbs"]
    m = LinkMatrix.model_validate(yaml.safe_load(dump(data, False)))  # what `pipemorph place` reads
    assert m.world_size == 3
    assert m.latency(0, 2) == m.latency(2, 0) == pytest.approx(30.0)
    assert m.latency(0, 1) == pytest.approx(0.1) and m.latency(1, 2) == pytest.approx(0.2)
    assert m.bandwidth(0, 1) == m.bandwidth(1, 0) == pytest.approx(2.0, rel=1e-4)  # the slower direction
    assert m.bandwidth(0, 2) == pytest.approx(3.0, rel=1e-4)
    assert m.bandwidth(1, 2) == pytest.approx(2.5, rel=1e-4)  # median of 2.0 and 3.0
