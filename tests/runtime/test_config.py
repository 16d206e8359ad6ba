"""The "pipemorph" ds_config section and the plans it selects, refused in one sentence when wrong."""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.plan.simulate import peak_inflight, warmup_counts
from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config
from ds_pipemorph.runtime.plans import build_plan
from ds_pipemorph.runtime.transport import decode_header, encode_header


@pytest.mark.parametrize("section,message", [
    ({"schedule": "zbb"}, "ds_config pipemorph: schedule: Input should be '1f1b', 'zb', 'adaptive' or 'plan'"),
    ({"shedule": "zb"}, "ds_config pipemorph: unknown key 'shedule'"),
    ({"memory": {"max_inflight": 0}}, "ds_config pipemorph: memory.max_inflight: every stage must hold at least 1 activation, got 0"),
    ({"adapt": {"every_iterations": "often"}}, "ds_config pipemorph: adapt.every_iterations: Input should be a valid integer, unable to parse string as an integer"),
    ({"delegation": {"mode": "sometimes"}}, "ds_config pipemorph: delegation.mode: Input should be 'off', 'auto' or 'always'"),
    ({"inject": {"links": {"2": {"delay": 30}}}}, "ds_config pipemorph: unknown key 'inject.links.2.delay'"),
    ({"delegation": {"queues": 4, "max_queues": 3}}, "ds_config pipemorph: delegation: delegation.max_queues (3) must be at least delegation.queues (4)"),
    ({"delegation": {"interfaces": []}}, 'ds_config pipemorph: delegation.interfaces: must be a non-empty list of network interface names, e.g. ["eth0", "eth1"]'),
    ({"delegation": {"interfaces": "eth0"}}, "ds_config pipemorph: delegation.interfaces: Input should be a valid list"),
    ({"delegation": {"slots": 1}}, "ds_config pipemorph: delegation.slots: Input should be greater than or equal to 2"),
    ({"delegation": {"slot_mb": 0}}, "ds_config pipemorph: delegation.slot_mb: Input should be greater than or equal to 1"),
    ({"schedule": "plan"}, "ds_config pipemorph: schedule 'plan' needs plan_file: the path of a plan from `pipemorph plan`"),
    ({"schedule": "zb", "plan_file": "p.yaml"}, "ds_config pipemorph: plan_file is only read with schedule 'plan', not 'zb'"),
])
def test_bad_section_is_refused_naming_the_key(section, message):
    with pytest.raises(PipeMorphConfigError) as e:
        parse_config(section)
    assert str(e.value) == message


def test_injection_naming_a_missing_link_a_negative_delay_or_an_unreadable_trace_is_refused(tmp_path):
    from ds_pipemorph.fileio import BadInput
    from ds_pipemorph.runtime.inject import delay_schedule

    with pytest.raises(BadInput, match=r"^ds_config pipemorph.inject.links names link 7, but a 4-stage pipeline has links 0..2$"):
        delay_schedule(parse_config({"inject": {"links": {"7": {"delay_ms": 30}}}}).inject, 4)
    with pytest.raises(PipeMorphConfigError, match=r"inject.links.2.delay_ms: Input should be greater than or equal to 0"):
        parse_config({"inject": {"links": {"2": {"delay_ms": -5}}}})
    with pytest.raises(BadInput, match=r"^inject.trace: cannot read"):
        delay_schedule(parse_config({"inject": {"trace": str(tmp_path / "nope.yaml")}}).inject, 4)
    bad = tmp_path / "bad.yaml"
    bad.write_text("points: [{t: 0, links_ms: [1, 2]}]")
    with pytest.raises(BadInput, match="has 2 delays, the job has 3 links"):
        delay_schedule(parse_config({"inject": {"trace": str(bad)}}).inject, 4)
    sched = delay_schedule(parse_config({"inject": {"links": {"2": {"delay_ms": 30}}}}).inject, 4)
    assert [sched.delay_ms(i) for i in range(3)] == [0, 0, 30]
    assert delay_schedule(parse_config({}).inject, 4) is None


def test_defaults_are_designs_and_accepted():
    cfg = parse_config(None)
    assert (cfg.schedule, cfg.delegation.mode, cfg.adapt.enabled, cfg.nvtx, cfg.timeline) == ("adaptive", "auto", True, True, None)


def test_zb_uses_zb_h1_warmup_or_max_inflight():
    assert warmup_counts(build_plan(parse_config({"schedule": "zb"}), 4, 12)) == [4, 3, 2, 1]
    plan = build_plan(parse_config({"schedule": "zb", "memory": {"max_inflight": [6, 4, 2, 1]}}), 4, 12)
    assert warmup_counts(plan) == [6, 4, 2, 1] and peak_inflight(plan) == [6, 4, 2, 1]


def test_adaptive_uses_alg1_warmup_under_the_caps():
    assert warmup_counts(build_plan(parse_config({"schedule": "adaptive"}), 4, 8)) == [8, 5, 3, 1]
    capped = build_plan(parse_config({"schedule": "adaptive", "memory": {"max_inflight": 4}}), 4, 8)
    assert max(peak_inflight(capped)) <= 4


def test_max_inflight_per_stage_must_match_the_stage_count():
    with pytest.raises(PipeMorphConfigError, match="^ds_config pipemorph.memory.max_inflight has 3 values but the job has 4 stages$"):
        build_plan(parse_config({"schedule": "zb", "memory": {"max_inflight": [3, 2, 1]}}), 4, 8)


def test_zb_warmup_that_grows_downstream_is_refused():
    with pytest.raises(PipeMorphConfigError, match="Lemma 1"):
        build_plan(parse_config({"schedule": "zb", "memory": {"max_inflight": [1, 2]}}), 2, 8)


def test_plan_file_for_other_micro_batch_count_is_refused(tmp_path):
    from ds_pipemorph.plan.baselines import zb_h1
    from ds_pipemorph.plan.profile import Costs

    from .plans_io import write_plan

    path = write_plan(tmp_path / "p.yaml", zb_h1(Costs.uniform(2), 4), 4)
    with pytest.raises(PipeMorphConfigError) as e:
        build_plan(parse_config({"schedule": "plan", "plan_file": path}), 2, 8)
    assert str(e.value) == f"plan file {path} is for 4 micro-batches but the job runs 8 (gradient_accumulation_steps)"


def test_message_header_round_trips_dtypes_shapes_and_tuple_structure():
    ts = [torch.zeros(2, 3), torch.ones(4, dtype=torch.int64), torch.zeros((), dtype=torch.bool), torch.zeros(1, 2, 3, 4)]
    bare, metas = decode_header(encode_header(ts, bare=False))
    assert not bare and metas == [(t.dtype, list(t.shape)) for t in ts]
    assert decode_header(encode_header([torch.zeros(5, 7)], bare=True)) == (True, [(torch.float32, [5, 7])])
