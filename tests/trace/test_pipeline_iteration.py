"""The pipeline's measured iteration is the union of its ranks' iterations, never shorter than any.

Hand-built timelines (ms, on one clock). Before this definition the pipeline's iteration was the
span of the compute ops alone, 177 ms here against ranks of 185 and 207 ms.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.plan.ir.ops import Op
from ds_pipemorph.trace.measured import IterMark, MeasuredOp, MeasuredTrace, RankTrace, analyze

MS = 1_000_000


def op(what, text, start_ms, end_ms, k=0):
    return MeasuredOp(what, Op(text[0], int(text[1:])), round(start_ms * MS), round(end_ms * MS), k)


# Stage 0 computes F0 10-20, B0 60-70, W0 70-80 (30 ms busy) and waits for B0's gradient 22-60;
# its ITER0 range, which holds the optimizer step after W0, is 0-185 ms.
STAGE0 = [op("compute", "F0", 10, 20), op("send", "F0", 20, 22), op("recv", "B0", 22, 60),
          op("compute", "B0", 60, 70), op("compute", "W0", 70, 80)]
# Stage 1 waits for F0's activation 2-25, computes F0 25-35, B0 35-45, W0 150-187 (57 ms busy);
# its ITER0 range is 2-209 ms.
STAGE1 = [op("recv", "F0", 2, 25), op("compute", "F0", 25, 35), op("compute", "B0", 35, 45),
          op("send", "B0", 45, 50), op("compute", "W0", 150, 187)]


def trace(marks: bool) -> MeasuredTrace:
    m0 = {0: IterMark(0, 185 * MS)} if marks else {}
    m1 = {0: IterMark(2 * MS, 209 * MS)} if marks else {}
    return MeasuredTrace("hand", [RankTrace(0, 0, None, list(STAGE0), m0), RankTrace(1, 1, None, list(STAGE1), m1)])


def test_with_iter_ranges_the_pipeline_spans_from_the_first_rank_start_to_the_last_rank_end():
    a = analyze(trace(marks=True)).to_json()
    # Ranks: 185 - 0 = 185 ms and 209 - 2 = 207 ms (the compute ops alone span 10-187 = 177 ms).
    assert [r["iteration_ms"]["mean"] for r in a["ranks"]] == [185.0, 207.0]
    # Pipeline: earliest start 0 to latest end 209 = 209 ms; busiest rank 57 ms -> bubble 152 / 209.
    assert a["pipeline"]["iteration_ms"]["mean"] == 209.0
    assert a["pipeline"]["bubble_rate"]["mean"] == pytest.approx(152 / 209, abs=1e-12)


def test_without_iter_ranges_ranks_and_pipeline_span_their_ops_of_every_kind():
    a = analyze(trace(marks=False)).to_json()
    # Stage 0: F0 starts at 10, W0 ends at 80 -> 70 ms; stage 1: RECV_F0 at 2 to W0's end 187 -> 185 ms.
    assert [r["iteration_ms"]["mean"] for r in a["ranks"]] == [70.0, 185.0]
    # Pipeline: 2 to 187 = 185 ms (not the compute span 10-187 = 177 ms); bubble (185 - 57) / 185.
    assert a["pipeline"]["iteration_ms"]["mean"] == 185.0
    assert a["pipeline"]["bubble_rate"]["mean"] == pytest.approx(128 / 185, abs=1e-12)


@st.composite
def traces(draw):
    """2-4 ranks, 1-3 iterations each 1000 ms apart; per rank and iteration a few ops at random
    times, and with marks an ITER range around them with random margins (the optimizer step)."""
    ranks, iterations = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    marks = draw(st.booleans())
    out = []
    for r in range(ranks):
        ops, its = [], {}
        for k in range(iterations):
            base = 1000 * k
            times = sorted(draw(st.lists(st.integers(0, 400), min_size=2, max_size=8)))
            what = draw(st.lists(st.sampled_from(["compute", "send", "recv"]), min_size=len(times) - 1,
                                 max_size=len(times) - 1))
            what[0] = "compute"  # every rank computes in every iteration: all are complete
            for (a, b), w in zip(zip(times, times[1:]), what):
                ops.append(op(w, "F0" if w != "compute" else "B0", base + a, base + b, k))
            if marks:
                lead, tail = draw(st.integers(0, 50)), draw(st.integers(0, 200))
                its[k] = IterMark((base + times[0] - lead) * MS, (base + times[-1] + tail) * MS)
        out.append(RankTrace(r, r, None, ops, its))
    return MeasuredTrace("drawn", out)


@settings(max_examples=200, deadline=None)
@given(traces())
def test_the_pipeline_iteration_is_never_shorter_than_any_ranks(tr):
    a = analyze(tr)
    for p in a.pipeline:
        for _, rows in a.ranks:
            mine = [x for x in rows if x.iteration == p.iteration]
            assert all(x.iteration_ms <= p.iteration_ms for x in mine)
    mean = a.to_json()["pipeline"]["iteration_ms"]["mean"]
    assert all(r["iteration_ms"]["mean"] <= mean + 1e-9 for r in a.to_json()["ranks"])
