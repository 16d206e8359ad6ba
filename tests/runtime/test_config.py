"""The "pipemorph" ds_config section and the plans it selects, refused in one sentence when wrong."""
from __future__ import annotations

import re

import pytest
import torch

from ds_pipemorph.plan.ir.ops import peak_inflight, warmup_counts
from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config
from ds_pipemorph.runtime.plans import build_plan
from ds_pipemorph.runtime.transport.header import decode_header, encode_header


@pytest.mark.parametrize("section,message", [
    ({"schedule": "zbb"}, "ds_config pipemorph: schedule: Input should be '1f1b', 'zb', 'adaptive' or 'plan', got the string 'zbb'"),
    ({"shedule": "zb"}, "ds_config pipemorph: unknown key 'shedule'"),
    ({"memory": {"max_inflight": 0}}, "ds_config pipemorph: memory.max_inflight: every stage must hold at least 1 activation, got 0"),
    ({"adapt": {"every_iterations": "often"}}, "ds_config pipemorph: adapt.every_iterations: expected an integer, got the string 'often'"),
    ({"delegation": {"mode": "sometimes"}}, "ds_config pipemorph: delegation.mode: Input should be 'off', 'auto' or 'always', got the string 'sometimes'"),
    ({"inject": {"links": {"2": {"delay": 30}}}}, "ds_config pipemorph: unknown key 'inject.links.2.delay'"),
    ({"delegation": {"queues": 4, "max_queues": 3}}, "ds_config pipemorph: delegation: delegation.max_queues (3) must be at least delegation.queues (4)"),
    ({"delegation": {"interfaces": []}}, 'ds_config pipemorph: delegation.interfaces: must be a non-empty list of network interface names, e.g. ["eth0", "eth1"]'),
    ({"delegation": {"interfaces": "eth0"}}, "ds_config pipemorph: delegation.interfaces: expected a list, got the string 'eth0'"),
    ({"delegation": {"slots": 1}}, "ds_config pipemorph: delegation.slots: Input should be greater than or equal to 2, got the integer 1"),
    ({"delegation": {"slot_mb": 0}}, "ds_config pipemorph: delegation.slot_mb: Input should be greater than or equal to 1, got the integer 0"),
    ({"schedule": "plan"}, "ds_config pipemorph: schedule 'plan' needs plan_file: the path of a plan from `pipemorph plan`"),
    ({"schedule": "zb", "plan_file": "p.yaml"}, "ds_config pipemorph: plan_file is only read with schedule 'plan', not 'zb'"),
    ({"recv_window": 0}, "ds_config pipemorph: recv_window: Input should be greater than or equal to 1, got the integer 0"),
    # A key that takes a list or a number: the path names keys only, down to the item at fault.
    ({"memory": {"max_inflight": "seven"}}, "ds_config pipemorph: memory.max_inflight: expected an integer, got the "
     "string 'seven'"),
    ({"memory": {"max_inflight": [1, "x"]}}, "ds_config pipemorph: memory.max_inflight.1: expected an integer, got "
     "the string 'x'"),
    ({"schedule": "plan", "plan_file": "p.yaml", "recv_window": 3}, "ds_config pipemorph: recv_window does not apply "
     "to a plan file, which names its own: set recv_window in the plan file instead"),
    ({"schedule": "plan", "plan_file": "p.yaml", "backward": "fused"}, "ds_config pipemorph: backward does not apply "
     "to a plan file, which names its own: set backward in the plan file instead"),
    ({"backward": "whole"}, "ds_config pipemorph: backward: Input should be 'split' or 'fused', got the string 'whole'"),
    ({"backward": "fused"}, "ds_config pipemorph: backward 'fused' runs the orders of schedule '1f1b' and 'zb' as "
     "written; 'adaptive' plans and re-plans for a split backward: set backward to 'split' or choose another schedule"),
])
def test_bad_section_is_refused_naming_the_key(section, message):
    with pytest.raises(PipeMorphConfigError) as e:
        parse_config(section)
    assert str(e.value) == message


# Types are checked, not converted: a value JSON or YAML reads as the wrong type is refused naming the type
# the key takes and the value given; only a whole number stands for a number (JSON writes 30.0 as 30).
@pytest.mark.parametrize("section,message", [
    ({"memory": {"max_inflight": "7"}}, "memory.max_inflight: expected an integer, got the string '7'"),
    ({"memory": {"max_inflight": True}}, "memory.max_inflight: expected an integer, got the boolean true"),
    ({"memory": {"max_inflight": [4, True]}}, "memory.max_inflight.1: expected an integer, got the boolean true"),
    ({"adapt": {"enabled": "yes"}}, "adapt.enabled: expected a boolean (true or false), got the string 'yes'"),
    ({"adapt": {"enabled": 1}}, "adapt.enabled: expected a boolean (true or false), got the integer 1"),
    ({"timeout_s": "30"}, "timeout_s: expected a number, got the string '30'"),
    ({"timeout_s": True}, "timeout_s: expected a number, got the boolean true"),
    ({"recv_window": 4.0}, "recv_window: expected an integer, got the number 4.0"),
    ({"delegation": {"slot_mb": "64"}}, "delegation.slot_mb: expected an integer, got the string '64'"),
    ({"memory": 4}, "memory: expected a mapping of keys, got the integer 4"),
    ({"timeline": 3}, "timeline: expected a string, got the integer 3"),
    ({"inject": {"links": {"2": {"delay_ms": "30"}}}},
     "inject.links.2.delay_ms: expected a number, got the string '30'"),
    ({"inject": {"nccl_rules": "true"}},
     "inject.nccl_rules: expected a boolean (true or false), got the string 'true'"),
    ({"inject": {"migration_drop": [False]}}, "inject.migration_drop.0: expected an integer, got the boolean false"),
])
def test_types_are_checked_not_converted(section, message):
    with pytest.raises(PipeMorphConfigError) as e:
        parse_config(section)
    assert str(e.value) == f"ds_config pipemorph: {message}"


def test_a_whole_number_is_accepted_where_a_number_is_expected_from_json_and_yaml():
    import json

    import yaml

    text = ('{"timeout_s": 30, "rebalance": {"timeout_s": 5, "noise": 1}, "orchestrate": {"grad_mb": 0}, '
            '"memory": {"max_inflight": [4, 3]}, "adapt": {"enabled": false}, '
            '"inject": {"links": {"1": {"delay_ms": 30}}}}')
    for section in (json.loads(text), yaml.safe_load(text)):
        cfg = parse_config(section)
        assert cfg.timeout_s == 30.0 and type(cfg.timeout_s) is float
        assert (cfg.rebalance.timeout_s, cfg.rebalance.noise, cfg.orchestrate.grad_mb) == (5.0, 1.0, 0.0)
        assert type(cfg.rebalance.noise) is float and type(cfg.inject.links["1"].delay_ms) is float
        assert cfg.memory.max_inflight == [4, 3] and cfg.adapt.enabled is False


def test_injection_naming_a_missing_link_a_negative_delay_or_an_unreadable_trace_is_refused(tmp_path):
    from ds_pipemorph.fileio import BadInput
    from ds_pipemorph.inject.delays import delay_schedule

    with pytest.raises(BadInput, match=r"^ds_config pipemorph.inject.links names link 7, but a 4-stage pipeline has links 0..2$"):
        delay_schedule(parse_config({"inject": {"links": {"7": {"delay_ms": 30}}}}).inject, 4)
    with pytest.raises(PipeMorphConfigError, match=r"inject.links.2.delay_ms: Input should be greater than or equal to 0, got the integer -5$"):
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
    # Default: stock 1F1B's memory, S - s micro-batches' activations; Alg. 1 under those caps.
    assert warmup_counts(build_plan(parse_config({"schedule": "adaptive"}), 4, 8)) == [4, 3, 2, 1]
    unlimited = build_plan(parse_config({"schedule": "adaptive", "memory": {"budget": None}}), 4, 8)
    assert warmup_counts(unlimited) == [8, 5, 3, 1]  # Alg. 1: x_0 = N, slackness (8-1)//3 = 2, one more on link 0
    capped = build_plan(parse_config({"schedule": "adaptive", "memory": {"max_inflight": 4}}), 4, 8)
    assert max(peak_inflight(capped)) <= 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "adaptive"])
@pytest.mark.parametrize("budget", [1.0, 1.5, 2.0, 3.0])
def test_every_built_in_plan_keeps_within_the_memory_budget(schedule, budget):
    """What F keeps for B and what B keeps for W (all of it, the generic split) stay within budget x
    stock 1F1B's S - s micro-batches on every stage; a larger budget never plans a slower order."""
    from ds_pipemorph.plan.ir.memory import peak_units
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sim.simulate import makespan

    S, N = 4, 12
    plan = build_plan(parse_config({"schedule": schedule, "memory": {"budget": budget}}), S, N)
    assert all(p <= budget * (S - s) + 1e-9 for s, p in enumerate(peak_units(plan, 1.0))), peak_units(plan, 1.0)
    costs = Costs.uniform(S, 10.0)
    tighter = build_plan(parse_config({"schedule": schedule, "memory": {"budget": 1.0}}), S, N)
    assert makespan(plan, costs, N) <= makespan(tighter, costs, N) + 1e-9


def test_the_memory_budget_forms():
    mem = parse_config({"memory": {"max_inflight": [6, 4, 2, 1]}}).memory
    assert mem.budget_in_force is None and mem.units(4) is None  # a count alone is the grant
    both = parse_config({"memory": {"max_inflight": 5, "budget": 1.5}}).memory
    assert both.units(4) == [6.0, 4.5, 3.0, 1.5]
    assert parse_config({}).memory.units(3) == [3.0, 2.0, 1.0]
    with pytest.raises(PipeMorphConfigError, match="memory.budget.*0.5 leaves the last stage less than one "
                                                   "micro-batch's activations"):
        parse_config({"memory": {"budget": 0.5}})


def test_max_inflight_per_stage_must_match_the_stage_count():
    with pytest.raises(PipeMorphConfigError, match="^ds_config pipemorph.memory.max_inflight has 3 values but the job has 4 stages$"):
        build_plan(parse_config({"schedule": "zb", "memory": {"max_inflight": [3, 2, 1]}}), 4, 8)


def test_zb_warmup_that_grows_downstream_is_refused():
    with pytest.raises(PipeMorphConfigError, match="Lemma 1"):
        build_plan(parse_config({"schedule": "zb", "memory": {"max_inflight": [1, 2]}}), 2, 8)


def test_plan_file_for_other_micro_batch_count_is_refused(tmp_path):
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.sched.baselines import zb_h1

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


def test_initialize_has_deepspeed_initializes_parameters():
    import inspect

    import deepspeed

    import ds_pipemorph

    ours = list(inspect.signature(ds_pipemorph.initialize).parameters.values())
    theirs = list(inspect.signature(deepspeed.initialize).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_config_is_read_from_a_dict_a_path_or_base64_json_as_deepspeed_reads_it(tmp_path):
    import base64
    import json

    from ds_pipemorph.runtime.initialize import load_config

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
           "pipemorph": {"schedule": "zb", "memory": {"max_inflight": [4, 3, 2, 1]}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    commented = tmp_path / "ds_config.jsonc"  # DeepSpeed reads files as HJSON: comments are allowed
    commented.write_text('// a comment\n' + json.dumps(cfg, indent=1).replace('"zb",', '"zb",  // ZB-H1'))
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    for form in (cfg, str(path), path, str(commented), encoded):
        assert load_config(form) == cfg, form
    copied = load_config(cfg)
    copied["pipemorph"]["schedule"] = "1f1b"
    assert cfg["pipemorph"]["schedule"] == "zb"  # the caller's dict is not touched


def test_unreadable_configs_are_refused_in_one_sentence(tmp_path, monkeypatch):
    import base64

    from ds_pipemorph.runtime.initialize import load_config

    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    monkeypatch.chdir(tmp_path)
    missing = "nope.json"  # relative: the message gives a path of up to 80 characters whole
    cases = [
        (missing, f"DeepSpeed config '{missing}' is neither an existing file nor base64-encoded JSON"),
        (str(listed), f"DeepSpeed config {listed}: expected a JSON object, got list"),
        (base64.urlsafe_b64encode(b"[1, 2]").decode(), "DeepSpeed config (base64): expected a JSON object, got list"),
        (42, "the DeepSpeed config must be a dict, a JSON file path or base64-encoded JSON, got int"),
    ]
    for config, message in cases:
        with pytest.raises(PipeMorphConfigError) as e:
            load_config(config)
        assert str(e.value) == message
    with pytest.raises(PipeMorphConfigError) as e:  # DeepSpeed's own reader names the duplicate key
        load_config(str(bad))
    assert str(e.value).startswith(f"DeepSpeed config {bad}: cannot be read as JSON (")
    assert "train_micro_batch_size_per_gpu" in str(e.value) and "\n" not in str(e.value)


def test_config_given_both_as_argument_and_in_args_is_refused_as_deepspeed_refuses_it(tmp_path):
    import argparse

    import ds_pipemorph

    path = tmp_path / "ds_config.json"
    path.write_text("{}")
    both = ("the DeepSpeed config was given twice, as config= and as args.deepspeed_config (--deepspeed_config): "
            "pass only one")
    for kwargs in ({"config": {}}, {"config_params": {}}):
        with pytest.raises(PipeMorphConfigError) as e:
            ds_pipemorph.initialize(args=argparse.Namespace(deepspeed_config=str(path)), **kwargs)
        assert str(e.value) == both
    with pytest.raises(PipeMorphConfigError) as e:
        ds_pipemorph.initialize(args=argparse.Namespace(deepspeed_config=None))
    assert str(e.value) == ("no DeepSpeed config: pass config= (a dict, a JSON file path or base64-encoded JSON) "
                            "or args.deepspeed_config (--deepspeed_config)")
    # One source, in any of DeepSpeed's places, gets past the config check (on to the model check).
    for args, kwargs in ((argparse.Namespace(deepspeed_config=str(path)), {}),
                         (argparse.Namespace(deepspeed_config=None), {"config_params": str(path)}),
                         (argparse.Namespace(deepscale_config=str(path)), {})):
        with pytest.raises(PipeMorphConfigError) as e:
            ds_pipemorph.initialize(args=args, model=None, **kwargs)
        assert str(e.value) == "ds_pipemorph.initialize needs a deepspeed PipelineModule as model"


def test_settings_the_chosen_schedule_ignores_are_named_at_start_up():
    from ds_pipemorph.runtime.config import pending_notes

    assert pending_notes(parse_config({"schedule": "plan", "plan_file": "p.yaml", "adapt": {"enabled": True},
                                       "delegation": {"mode": "off"}})) == [
        "pipemorph.adapt re-plans with schedule 'adaptive' only: the 'plan' schedule runs unchanged "
        "(drop 'adapt' or set adapt.enabled false)"]
    # Off, or left at its default, adapt says nothing; under "adaptive" it is what runs.
    off = {"schedule": "zb", "adapt": {"enabled": False}, "delegation": {"mode": "off"}}
    assert pending_notes(parse_config(off)) == []
    assert pending_notes(parse_config({"schedule": "zb", "delegation": {"mode": "off"}})) == []
    # delegation 'auto' is named only when the config asks for it: left at its default it says nothing
    assert pending_notes(parse_config({"schedule": "zb", "adapt": {"enabled": False}})) == []
    assert pending_notes(parse_config({"schedule": "zb", "adapt": {"enabled": False},
                                       "delegation": {"mode": "auto"}})) == [
        "pipemorph.delegation 'auto' follows the straggler detector, which runs with schedule 'adaptive' and "
        "adapt.enabled only: every link stays direct"]
    assert pending_notes(parse_config({"schedule": "adaptive", "adapt": {"every_iterations": 2}})) == []


def test_the_configs_receive_window_lowers_built_plans():
    from ds_pipemorph.plan.ir.lower import LoweringPolicy
    from ds_pipemorph.runtime.config import pending_notes
    from ds_pipemorph.runtime.plans import lowering_for

    assert lowering_for(parse_config({"schedule": "zb"})) == LoweringPolicy(recv_window=1)
    assert lowering_for(parse_config({"schedule": "1f1b", "recv_window": 12})) == LoweringPolicy(recv_window=12)
    assert pending_notes(parse_config({"schedule": "zb", "dispatch": "ready", "recv_window": 4,
                                       "delegation": {"mode": "off"}})) == [
        "pipemorph.recv_window applies to dispatch 'ordered': dispatch 'ready' posts every receive of an "
        "iteration before the first op that needs one"]


def test_ready_dispatch_with_injected_link_faults_is_refused_in_one_sentence():
    with pytest.raises(PipeMorphConfigError, match="cannot be combined with dispatch 'ready'"):
        parse_config({"dispatch": "ready", "inject": {"faults": {"link_fails_after": {"0": 3}}}})
    assert parse_config({"dispatch": "ready"}).dispatch == "ready"
    with pytest.raises(PipeMorphConfigError, match="dispatch"):
        parse_config({"dispatch": "eager"})


# -- memory.budget_mb ------------------------------------------------------------------------------------

def test_a_grant_in_mib_is_refused_beside_a_factor_or_with_the_wrong_stage_count():
    with pytest.raises(PipeMorphConfigError, match="^ds_config pipemorph: memory: budget and budget_mb both grant "
                                                   "activation memory: give one of them"):
        parse_config({"memory": {"budget_mb": 64, "budget": 2.0}})
    with pytest.raises(PipeMorphConfigError, match="budget and budget_mb both grant"):  # null is a factor too
        parse_config({"memory": {"budget_mb": 64, "budget": None}})
    for bad in (0, -1.5, [64, 0]):
        with pytest.raises(PipeMorphConfigError, match="memory.budget_mb: every stage needs some activation memory"):
            parse_config({"memory": {"budget_mb": bad}})
    with pytest.raises(PipeMorphConfigError, match="memory.budget_mb: expected a number"):
        parse_config({"memory": {"budget_mb": "64"}})
    with pytest.raises(PipeMorphConfigError, match="^ds_config pipemorph.memory.budget_mb has 3 values but the job "
                                                   "has 4 stages: give one value per stage, or one for all$"):
        build_plan(parse_config({"schedule": "zb", "memory": {"budget_mb": [64, 64, 64]}}), 4, 8)
    mem = parse_config({"memory": {"budget_mb": 64, "max_inflight": 3}}).memory  # a count and bytes: both hold
    assert mem.mib_per_stage(2) == [64.0, 64.0] and mem.per_stage(2) == [3, 3]


def test_until_the_grant_is_measured_the_job_plans_within_stock_1f1b_s_budget():
    from ds_pipemorph.runtime.plans import memory_budget

    cfg = parse_config({"schedule": "adaptive", "memory": {"budget_mb": [1.0, 1.0, 1.0, 1.0]}})
    assert cfg.memory.budget_in_force == 1.0 and cfg.send_window_in_force is not None
    start = memory_budget(cfg, 4, 8)
    assert start.units == (4.0, 3.0, 2.0, 1.0) and start.caps == (4, 3, 2, 1) and start.mib is None
    assert build_plan(cfg, 4, 8) == build_plan(parse_config({"schedule": "adaptive"}), 4, 8)


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "adaptive"])
def test_a_grant_becomes_micro_batches_of_each_stage_s_measured_activations(schedule):
    """1 MiB per stage where F keeps 0.25, 0.25, 0.4 and 0.5 MiB per micro-batch: 4, 4, 2.5 and 2
    micro-batches; every plan made within it holds no more (W pending counted as all of F's)."""
    from ds_pipemorph.plan.ir.memory import peak_units
    from ds_pipemorph.runtime.plans import granted_budget

    MIB = 1024 * 1024
    S, N = 4, 8
    cfg = parse_config({"schedule": schedule, "memory": {"budget_mb": 1}})
    f = [MIB // 4, MIB // 4, int(0.4 * MIB), MIB // 2]
    budget = granted_budget(cfg, S, N, f)
    assert budget.units == pytest.approx([4.0, 4.0, 2.5, 2.0]) and budget.caps == (4, 4, 2, 2)
    assert budget.mib == (1.0, 1.0, 1.0, 1.0)
    plan = build_plan(cfg, S, N, budget=budget)  # (1f1b: stock's S - s fits on every stage)
    held = peak_units(plan, 1.0)
    assert all(held[s] * f[s] <= MIB for s in range(S)), held


def test_a_grant_tighter_than_stock_1f1b_s_order_is_refused_for_1f1b_but_planned_for_zb():
    from ds_pipemorph.plan.ir.memory import peak_units
    from ds_pipemorph.runtime.plans import granted_budget

    S, N, f = 4, 8, [1000] * 4
    for schedule in ("zb", "adaptive"):
        cfg = parse_config({"schedule": schedule, "memory": {"budget_mb": 2000 / 1024 / 1024}})
        plan = build_plan(cfg, S, N, budget=granted_budget(cfg, S, N, f))
        assert max(peak_units(plan, 1.0)) <= 2.0, (schedule, peak_units(plan, 1.0))
    cfg = parse_config({"schedule": "1f1b", "memory": {"budget_mb": 2000 / 1024 / 1024}})
    with pytest.raises(PipeMorphConfigError) as e:
        granted_budget(cfg, S, N, f)
    # 1F1B holds S - s = 4, 3, 2, 1 micro-batches of 1000 B: 4000, 3000, 2000, 1000 B, in MiB rounded
    # up to 4 significant digits; stage 0 is the first below its need (2000 B < 4000 B).
    assert str(e.value) == ("pipemorph.memory.budget_mb gives stage 0 0.001907 MiB, less than the 4 micro-batches "
                            "the 1f1b order holds there (4 x 0.0009537 MiB measured in the first iteration): the "
                            "smallest budget_mb that runs is 0.003815 MiB on stage 0 ([0.003815, 0.002862, 0.001908, "
                            "0.0009537] per stage, or 0.003815 for every stage)")
    granted_budget(parse_config({"schedule": "1f1b", "memory": {"budget_mb": 0.003815}}), S, N, f)  # that runs


def test_a_plan_over_a_budget_mb_grant_names_the_least_grant_of_every_stage():
    from ds_pipemorph.plan.ir.memory import MemoryBudget
    from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
    from ds_pipemorph.runtime.plans import within_budget

    cfg = parse_config({"schedule": "zb", "memory": {"budget_mb": 1}})
    # 1 MiB per stage is 2 micro-batches' activations on every stage (0.5 MiB each); 1F1B's order holds
    # 4, 3, 2, 1 of them between F and B: 2, 1.5, 1 (the grant, which holds) and 1 MiB.
    budget = MemoryBudget(caps=(2, 2, 2, 2), units=(2.0, 2.0, 2.0, 2.0), mib=(1.0, 1.0, 1.0, 1.0))
    with pytest.raises(PipeMorphConfigError) as e:
        within_budget(cfg, deepspeed_1f1b(4, 8), "the '1f1b' plan", budget=budget)
    assert str(e.value) == ("the '1f1b' plan needs more activation memory than pipemorph.memory.budget_mb ([1, 1, 1, 1] "
                            "MiB per stage) allows: stage 0 holds 4 micro-batches between F and B, more than its "
                            "budget of 2; raise memory.budget_mb to at least 2 MiB on stage 0 ([2, 1.5, 1, 1] per "
                            "stage, or 2 for every stage)")


def test_a_grant_below_one_micro_batch_names_the_stage_its_measure_and_the_least_that_runs():
    from ds_pipemorph.runtime.plans import granted_budget

    MIB = 1024 * 1024
    cfg = parse_config({"memory": {"budget_mb": [2, 2, 1, 2]}})
    with pytest.raises(PipeMorphConfigError) as e:
        granted_budget(cfg, 4, 8, [MIB, MIB, int(1.5 * MIB), 2 * MIB])
    assert str(e.value) == ("pipemorph.memory.budget_mb gives stage 2 1 MiB, less than one micro-batch's activations "
                            "there (1.5 MiB measured in the first iteration): the smallest budget_mb that runs is "
                            "1.5 MiB on stage 2 ([1, 1, 1.5, 2] per stage, or 2 for every stage)")
    exact = granted_budget(cfg, 4, 8, [MIB, MIB, MIB, 2 * MIB])  # exactly one micro-batch: runs (fused-like)
    assert exact.units == (2.0, 2.0, 1.0, 1.0) and exact.caps == (2, 2, 1, 1)


def test_a_grant_in_mib_is_refused_with_a_plan_file_and_with_moving_layers_or_ranks(tmp_path):
    from types import SimpleNamespace

    from ds_pipemorph.runtime.compat import BUDGET_MB_MOVING_REFUSED, BUDGET_MB_PLAN_FILE_REFUSED
    from ds_pipemorph.runtime.assembly import moving_refusal

    with pytest.raises(PipeMorphConfigError, match=re.escape(BUDGET_MB_PLAN_FILE_REFUSED)):
        parse_config({"schedule": "plan", "plan_file": str(tmp_path / "p.yaml"), "memory": {"budget_mb": 64}})
    # The bytes a grant was converted with change when layers or ranks move: refused (start-up, repartition, remap).
    for grant, want in (({"budget_mb": 64}, BUDGET_MB_MOVING_REFUSED), ({"budget": 2.0}, None)):
        # (at start-up the engine has no ``pipemorph`` attribute yet: the section is given)
        engine = SimpleNamespace(zero_optimization=lambda: False, fp16_enabled=lambda: False,
                                 grid=SimpleNamespace(get_slice_parallel_world_size=lambda: 1))
        assert moving_refusal(engine, parse_config({"memory": grant})) == want


def test_zb_with_a_count_and_a_grant_rising_from_one_stage_to_the_next_keeps_the_warm_up_non_increasing():
    from ds_pipemorph.runtime.plans import granted_budget

    MIB = 1024 * 1024
    S, N = 4, 8
    cfg = parse_config({"schedule": "zb", "memory": {"budget_mb": 1, "max_inflight": 8}})
    # The last stage keeps half the bytes per micro-batch: its grant is twice the others' units.
    budget = granted_budget(cfg, S, N, [MIB // 2, MIB // 2, MIB // 2, MIB // 4])
    assert budget.caps == (2, 2, 2, 4)
    plan = build_plan(cfg, S, N, budget=budget)  # (refused before: "warm-up count 4 exceeds stage 2's 2")
    from ds_pipemorph.plan.ir.ops import warmup_counts
    assert list(warmup_counts(plan)) == [2, 2, 2, 2]  # the running minimum of the caps: Lemma 1's x_s >= x_(s+1)
