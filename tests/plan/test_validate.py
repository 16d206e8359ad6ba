"""Plan validity: every error names the first offending op."""
import pytest

from ds_pipemorph.plan.ir.ops import Op, parse_op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sim.validate import InvalidPlan, parse_schedule, validate_schedule


def good(stages=4, n=4):
    return list_schedule(Costs.uniform(stages, 10.0), n, [min(n, stages - s) for s in range(stages)])


def test_a_produced_plan_is_valid():
    validate_schedule(good(), 4, 4, caps=[4, 3, 2, 1])


def test_missing_op_is_named():
    s = good()
    s[1].remove(Op("W", 3))
    with pytest.raises(InvalidPlan, match=r"^stage 1: W3 is missing$"):
        validate_schedule(s, 4, 4)


def test_duplicate_op_is_named():
    s = good()
    s[2].append(Op("F", 0))
    with pytest.raises(InvalidPlan, match=r"stage 2: F0 appears twice"):
        validate_schedule(s, 4, 4)


def test_w_before_its_b_is_named():
    s = good()
    row = s[0]
    i, j = row.index(Op("B", 2)), row.index(Op("W", 2))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(InvalidPlan, match=r"stage 0: W2 before B2"):
        validate_schedule(s, 4, 4)


def test_orders_that_wait_on_each_other_are_named():
    # Stage 0 wants B0 before F1, but stage 1 only runs B0 after F1: a cycle.
    s = [
        [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("W", 0), Op("W", 1)],
        [Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1), Op("W", 0), Op("W", 1)],
    ]
    with pytest.raises(
        InvalidPlan,
        match=r"^stage 0: B0 cannot run: it waits for its input gradient B0 from stage 1, which is stuck at F1",
    ):
        validate_schedule(s, 2, 2)


def test_cap_violation_names_the_stage():
    with pytest.raises(InvalidPlan, match=r"stage 0: holds 4 activations at once, above its cap of 2"):
        validate_schedule(good(), 4, 4, caps=[2, 2, 2, 1])


def test_wrong_stage_count_and_unknown_microbatch():
    with pytest.raises(InvalidPlan, match="3 stage lists, the plan says 4"):
        validate_schedule(good()[:3], 4, 4)
    s = good()
    s[0][0] = Op("F", 9)
    with pytest.raises(InvalidPlan, match="stage 0: F9 names micro-batch 9"):
        validate_schedule(s, 4, 4)


def test_op_text_parsing():
    assert parse_op("B12") == Op("B", 12)
    assert str(Op("W", 3)) == "W3"
    with pytest.raises(ValueError, match="'X3' is not an op"):
        parse_op("X3")
    with pytest.raises(InvalidPlan, match="stage 1: 'F' is not an op"):
        parse_schedule([["F0"], ["F"]])
