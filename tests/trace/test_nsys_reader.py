"""Reading nsys SQLite exports: ranges -> per-rank timelines, and the measured figures, exactly.

Unit tests of parsing on hand-written rows (``nsys_rows.py``); ``tests/nvtx`` reads a real job's capture.
"""
import sqlite3

import pytest
from nsys_rows import START_END, Rows, gtid, three_stage, two_stage

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.ir.ops import Op
from ds_pipemorph.trace.measured import analyze, iteration_timeline
from ds_pipemorph.trace.nsys import pid_of, read_nsys, tid_of

pytestmark = pytest.mark.timeout(60)


def test_pid_and_tid_come_out_of_the_global_tid():
    g = gtid(4242, tid=4250, hw=3, vm=1)
    assert pid_of(g) == 4242 and tid_of(g) == 4250
    g = 0x03_01_001092_00109A  # hw 3, vm 1, pid 0x1092, tid 0x109A
    assert (pid_of(g), tid_of(g)) == (0x1092, 0x109A)


@pytest.mark.parametrize("registered", [True, False], ids=["textId", "inline-text"])
def test_two_stages_two_iterations_give_exact_figures(tmp_path, registered):
    t = read_nsys(two_stage(tmp_path / "r.sqlite", registered=registered))
    assert t.warnings == []
    assert [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 100), (1, 1, 101)]
    assert t.complete_iterations() == [0, 1]
    assert t.extra == {"session_start_utc_ns": 1700000000000000000}
    r0 = t.ranks[0]
    assert [o.name for o in r0.of("compute", 1)] == ["F0", "F1", "B0", "W0", "B1", "W1"]
    assert r0.of("compute", 1)[0].start_ns == 100_000_000 and r0.of("compute", 1)[0].end_ns == 110_000_000
    assert [o.name for o in t.ranks[1].of("recv", 0)] == ["RECV_F0", "RECV_F1"]

    a = analyze(t)
    assert a.iterations == [0, 1]
    (ra, its0), (rb, its1) = a.ranks
    assert [x.iteration_ms for x in its0] == [85.0, 90.0]  # ITER ranges
    assert [x.busy_ms for x in its0] == [60.0, 60.0]
    assert its0[0].bubble_rate == pytest.approx(25 / 85, abs=1e-12)
    assert its0[1].bubble_rate == pytest.approx(30 / 90, abs=1e-12)
    assert [(x.send_ms, x.recv_ms) for x in its0] == [(4.0, 18.0), (4.0, 18.0)]
    assert [(x.send_ms, x.recv_ms) for x in its1] == [(7.0, 14.0), (7.0, 14.0)]
    # Both ranks' ITER ranges are 0-85 and 100-190 ms: the pipeline's iterations span the same.
    assert [(p.iteration_ms, p.max_busy_ms) for p in a.pipeline] == [(85.0, 60.0), (90.0, 60.0)]
    assert a.pipeline[0].bubble_rate == pytest.approx(25 / 85, abs=1e-12)
    (link,) = a.links
    # forward 3, 17 and backward 7, 3 per iteration -> median of 3,3,3,3,7,7,17,17
    assert sorted(link.forward_ms) == [3.0, 3.0, 17.0, 17.0]
    assert sorted(link.backward_ms) == [3.0, 3.0, 7.0, 7.0]
    assert link.median_ms == 5.0 and link.messages == 8 and link.unmatched == 0
    j = a.to_json()
    assert j["ranks"][0]["iteration_ms"] == {"mean": 87.5, "median": 87.5}
    assert j["ranks"][1]["bubble_rate"]["mean"] == pytest.approx((25 / 85 + 30 / 90) / 2, abs=1e-12)


def test_three_stages_without_categories_or_iterations_map_pids_in_order(tmp_path):
    t = read_nsys(three_stage(tmp_path / "r.sqlite"))
    assert t.warnings == ["no stage category on the 'pipemorph' ranges: mapped 3 processes to stages 0..2 in pid order"]
    assert [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 100), (1, 1, 101), (2, 2, 102)]
    a = analyze(t)
    assert a.iterations == [0]
    spans = [its[0].iteration_ms for _, its in a.ranks]
    assert spans == [73.0, 62.0, 42.0]  # no ITER ranges: first to last op of the rank
    assert [its[0].busy_ms for _, its in a.ranks] == [30.0, 30.0, 10.0]
    assert a.ranks[2][1][0].bubble_rate == pytest.approx(32 / 42, abs=1e-12)
    assert [(its[0].send_ms, its[0].recv_ms) for _, its in a.ranks] == [(1.0, 42.0), (4.0, 28.0), (2.0, 30.0)]
    assert a.pipeline[0].iteration_ms == 73.0 and a.pipeline[0].bubble_rate == pytest.approx(43 / 73, abs=1e-12)
    assert [(ln.link, ln.median_ms, ln.messages) for ln in a.links] == [(1, 6.0, 2), (0, 2.5, 2)]  # slowest first


def test_data_parallel_ranks_come_from_the_iter_payload_not_from_pid_order(tmp_path):
    # pids 100..103 hold (stage, replica) (0, 1), (1, 0), (0, 0), (1, 1): global ranks 1, 2, 0, 3.
    t = read_nsys(two_stage(tmp_path / "r.sqlite", replicas=2, shift_replica_ms=300))
    assert t.warnings == []
    assert [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 102), (1, 0, 100), (2, 1, 101), (3, 1, 103)]
    # pid 102 has a range 'F0' [0, 500] ms in domain 'other' (same domain id as pid 100's pipemorph)
    assert all(o.end_ns <= 182_000_000 for o in t.ranks[0].ops)
    # Replica d of stage 0 talks to replica d of stage 1: paired so, every message takes what it took
    # in one replica (replica 1 runs 300 ms later; a pairing across replicas would be 300 ms off).
    (link,) = analyze(t).links
    assert link.messages == 16 and link.median_ms == 5.0 and max(link.latencies_ms) == 17.0 and link.unmatched == 0


def test_without_rank_payloads_replicas_pair_in_pid_order_with_a_warning(tmp_path):
    db = Rows(tmp_path / "r.sqlite")
    for pid, stage in ((100, 0), (101, 1), (102, 0), (103, 1)):
        db.domain(pid, 1)
        db.category(pid, 1, 1, f"stage{stage}")
        db.range(pid, 1, "ITER0", 0, 50, category=1)
        db.range(pid, 1, "F0", 10 * stage, 10 * stage + 10, category=1, payload=0)
    t = read_nsys(db.close())
    assert [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 100), (1, 0, 102), (2, 1, 101), (3, 1, 103)]
    assert t.warnings == ["no rank payload on the ITER ranges: the processes of stage 0 are paired with the other "
                          "stages' in pid order"]


def test_one_stage_per_process_needs_no_rank_payload(tmp_path):
    db = Rows(tmp_path / "r.sqlite")
    for pid, stage in ((300, 0), (200, 1)):
        db.domain(pid, 1)
        db.category(pid, 1, 1, f"stage{stage}")
        db.range(pid, 1, "F0", 10 * stage, 10 * stage + 10, category=1, payload=0)
    t = read_nsys(db.close())
    assert t.warnings == [] and [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 300), (1, 1, 200)]


@pytest.mark.parametrize("ranks, message", [
    ((0, 0), r"pids 100 and 101 both say they are rank 0"),
    ((0, None), r"pid 101 has no rank payload on its ITER ranges while other processes do"),
    (((0, 1), 1), r"pid 100 carries ITER ranges of ranks \[0, 1\]; one process is one rank"),
])
def test_contradicting_rank_payloads_are_one_sentence(tmp_path, ranks, message):
    db = Rows(tmp_path / "r.sqlite")
    for pid, rank in zip((100, 101), ranks):
        stage = pid - 100
        db.domain(pid, 1)
        db.category(pid, 1, 1, f"stage{stage}")
        for k, r in enumerate(rank if isinstance(rank, tuple) else (rank,)):
            db.range(pid, 1, f"ITER{k}", 100 * k, 100 * k + 50, category=1, payload=r)
            db.range(pid, 1, "F0", 100 * k + 10, 100 * k + 20, category=1, payload=0)
    with pytest.raises(BadInput, match=message):
        read_nsys(db.close())


def test_start_end_iteration_ranges_work_like_push_pop_ones(tmp_path):
    db = Rows(tmp_path / "r.sqlite")
    db.domain(100, 1)
    db.category(100, 1, 1, "stage0")
    for k in range(2):
        db.range(100, 1, f"ITER{k}", 100 * k, 100 * k + 50, category=1, payload=0, event_type=START_END)
        db.range(100, 1, "F0", 100 * k + 10, 100 * k + 20, category=1, payload=0)
    t = read_nsys(db.close())
    assert t.complete_iterations() == [0, 1] and [o.iteration for o in t.ranks[0].ops] == [0, 1]


def test_an_open_last_iteration_is_not_complete(tmp_path):
    t = read_nsys(two_stage(tmp_path / "r.sqlite", open_last_iter=True))
    assert t.iterations() == [0, 1] and t.complete_iterations() == [0]
    a = analyze(t)
    assert a.iterations == [0] and a.links[0].messages == 4


def test_iteration_timeline_is_the_measured_compute_of_one_iteration(tmp_path):
    tl = iteration_timeline(read_nsys(two_stage(tmp_path / "r.sqlite")), 1)
    assert tl.stages == 2 and tl.microbatches == 2 and tl.iteration_ms == 82.0
    assert tl.busy_ms == [60.0, 60.0] and tl.peak_inflight == [2, 1]
    first = {(s.stage, str(s.op)): (s.start, s.end) for s in tl.slots}
    assert first[(1, "F0")] == (13.0, 23.0) and first[(0, "W1")] == (72.0, 82.0)
    assert tl.bubble_rate == pytest.approx(22 / 82, abs=1e-12)
    assert {s.op for s in tl.slots if s.stage == 0} == {Op(k, m) for k in "FBW" for m in range(2)}


def test_not_sqlite_is_one_sentence(tmp_path):
    p = tmp_path / "r.sqlite"
    p.write_text("hello")
    with pytest.raises(BadInput, match=r"r\.sqlite: not an SQLite file"):
        read_nsys(p)


def test_sqlite_without_nvtx_events(tmp_path):
    p = tmp_path / "r.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)")
    con.commit()
    con.close()
    with pytest.raises(BadInput, match=r"r\.sqlite: no NVTX_EVENTS table"):
        read_nsys(p)


def test_sqlite_without_pipemorph_domain(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=True)
    db.domain(100, 1, "NCCL")
    db.range(100, 1, "F0", 0, 10)
    with pytest.raises(BadInput, match=r"no NVTX ranges in domain 'pipemorph'"):
        read_nsys(db.close())


def test_pipemorph_domain_without_op_ranges(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=False)
    db.domain(100, 1)
    db.range(100, 1, "OptimizerStep", 0, 10)
    with pytest.raises(BadInput, match=r"no 'pipemorph' op ranges"):
        read_nsys(db.close())


def test_mixed_stage_information_is_rejected(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=False)
    for pid, cat in ((100, 1), (101, None)):
        db.domain(pid, 1)
        if cat:
            db.category(pid, 1, cat, "stage0")
        db.range(pid, 1, "F0", 0, 10, category=cat)
    with pytest.raises(BadInput, match=r"pid 101 has no stage category while other processes do"):
        read_nsys(db.close())


def test_stage_prefix_in_the_message_works_like_a_category(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=True)
    for pid, stage in ((200, 1), (100, 0)):
        db.domain(pid, 1)
        db.range(pid, 1, f"stage{stage}/F0", 10 * stage, 10 * stage + 10)
    t = read_nsys(db.close())
    assert t.warnings == [] and [(r.rank, r.stage, r.pid) for r in t.ranks] == [(0, 0, 100), (1, 1, 200)]


def test_unclosed_ranges_and_wrong_payloads_are_left_out_with_warnings(tmp_path):
    db = Rows(tmp_path / "r.sqlite", registered=True)
    db.domain(100, 1)
    db.category(100, 1, 1, "stage0")
    db.range(100, 1, "F0", 0, 10, category=1, payload=0)
    db.range(100, 1, "F1", 10, 20, category=1, payload=5)
    db.range(100, 1, "B0", 20, None, category=1, payload=0)
    t = read_nsys(db.close())
    assert [o.name for o in t.ranks[0].ops] == ["F0", "F1"]
    assert t.warnings == ["1 op ranges never closed (or end before they start) and were left out",
                          "1 ranges carry a payload other than the micro-batch of their name"]
