"""A config the engine cannot use ends a recipe run with one sentence, printed once per job.

The tiny GPT recipe runs under torchrun on 2 CPU ranks from a working directory that is not the
config's, with its config in a directory of its own. Each rank exits 2 (torchrun reports the child
exit codes, may stop a rank still running first, and exits 1 itself); rank 0 prints ``error: <sentence>``; no rank prints a traceback (the
one traceback left is torchrun's own report of the failed children). Relative paths in the
``pipemorph`` section are read against the config file's directory, and the message names the
absolute path tried. The ``fp16`` case runs on a device without fp16 (``no_fp16_run.py``: DeepSpeed's
CPU accelerator has fp16 on CPUs with AVX512-FP16, where such a config trains).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import zb_h1
from ds_pipemorph.procs import free_port, run_group
from ds_pipemorph.runtime.compat import BUDGET_MB_MOVING_REFUSED, FUSED_CHECKPOINTING_REFUSED

from .launch import REPO
from .plans_io import write_plan

RECIPE = REPO / "recipes" / "tiny_gpt"


def _run_recipe(tmp_path: Path, pipemorph: dict, extra: dict | None = None, port: int | None = None,
                no_fp16: bool = False):
    conf = tmp_path / "conf"
    (conf / "plans").mkdir(parents=True, exist_ok=True)
    write_plan(conf / "plans" / "three_stages.yaml", zb_h1(Costs.uniform(3), 8), 8)
    cfg = {**json.loads((RECIPE / "ds_config.json").read_text()), **(extra or {}), "pipemorph": pipemorph}
    (conf / "ds_config.json").write_text(json.dumps(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    rendezvous = ["--standalone"] if port is None else ["--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
    script = [str(Path(__file__).with_name("no_fp16_run.py"))] if no_fp16 else []  # a device without fp16
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
           *script, str(RECIPE / "train.py"), "--stages", "2", "--steps", "1", "--config", "../conf/ds_config.json"]
    p = run_group(cmd, 600, cwd=elsewhere, env=env)
    return conf, p.returncode, p.stdout + p.stderr


CASES = {
    "missing_relative_plan": ({"schedule": "plan", "plan_file": "plans/missing.yaml"}, None,
                              "ds_config pipemorph.plan_file {conf}/plans/missing.yaml: no such file"),
    "plan_for_another_job": ({"schedule": "plan", "plan_file": "plans/three_stages.yaml"}, None,
                             "plan file {conf}/plans/three_stages.yaml is for 3 stages but the job has 2 pipeline "
                             "stages"),
    "unknown_key": ({"schedule": "zb", "shedule_hint": 1}, None, "ds_config pipemorph: unknown key 'shedule_hint'"),
    "fp16": ({"schedule": "zb"}, {"fp16": {"enabled": True}},
             "this device has no fp16 (DeepSpeed's cpu accelerator): use \"bf16\": {{\"enabled\": true}} instead "
             "of the \"fp16\" section, or remove it"),  # braces doubled: the sentences go through str.format
    "zero_stage_2": ({"schedule": "zb"}, {"zero_optimization": {"stage": 2}},
                     "pipeline parallelism runs with ZeRO stage 0 or 1 only (DeepSpeed's rule): set "
                     "zero_optimization.stage to 1 (it is 2)"),
    # tiny_gpt names no checkpointable_layers: DeepSpeed then checkpoints every layer with parameters,
    # the token embedding on the first stage included.
    "checkpointed_embedding": ({"schedule": "zb"}, {"pipeline": {"activation_checkpoint_interval": 1}},
                               "activation checkpointing needs every checkpointed chunk's input to need a gradient, "
                               "and the first stage's token ids do not (the embedding cannot be checkpointed): name "
                               "only the transformer blocks in the PipelineModule's checkpointable_layers"),
    "budget_mb_with_rebalance": ({"schedule": "zb", "memory": {"budget_mb": 64}, "rebalance": {"enabled": True}}, None,
                                 BUDGET_MB_MOVING_REFUSED),
    "fused_with_adaptive": ({"schedule": "adaptive", "backward": "fused"}, None,
                            "ds_config pipemorph: backward 'fused' runs the orders of schedule '1f1b' and 'zb' as "
                            "written; 'adaptive' plans and re-plans for a split backward: set backward to 'split' or "
                            "choose another schedule"),
    "fused_with_checkpointing": ({"schedule": "1f1b", "compare": {"schedule": "zb", "backward": "fused"}},
                                 {"pipeline": {"activation_checkpoint_interval": 1}}, FUSED_CHECKPOINTING_REFUSED),
}


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_config_ends_the_recipe_with_one_sentence_and_exit_code_2(tmp_path, case):
    pipemorph, extra, sentence = CASES[case]
    conf, code, output = _run_recipe(tmp_path, pipemorph, extra, no_fp16=case == "fp16")
    expected = "error: " + sentence.format(conf=conf)
    assert code == 1, output[-3000:]  # torchrun's own code when a child failed
    # Rank 0 exited 2 (torchrun may stop the other rank before it exits 2 as well).
    assert "exitcode  : 2" in output, output[-3000:]
    assert [line for line in output.splitlines() if line.startswith("error: ")] == [expected], output[-3000:]
    # The only traceback is torchrun's report of the failed children, none from a rank.
    assert output.count("Traceback") == output.count("raise ChildFailedError(") == 1, output[-3000:]
    assert "step " not in output  # no training step ran


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_grant_in_bytes_below_one_micro_batch_ends_the_recipe_after_its_first_iteration(tmp_path):
    """Known only once the first iteration measured: every rank refuses it at the same point, the first
    to end says it (``runtime.errors``: an error while training exits 1), and no rank waits for another."""
    conf, code, output = _run_recipe(tmp_path, {"schedule": "zb", "memory": {"budget_mb": 1e-6}})
    assert code == 1 and "exitcode  : 1" in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: pipemorph.memory.budget_mb gives stage 0 1e-06 MiB, less "
                                                     "than one micro-batch's activations there ("), output[-3000:]
    assert "the smallest budget_mb that runs is" in errors[0], errors[0]
    assert output.count("Traceback") == output.count("raise ChildFailedError(") == 1, output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_refusal_after_the_script_started_communication_leaves_no_shared_memory(tmp_path):
    """The recipe starts DeepSpeed's communication itself, before ``initialize`` reads the config: under
    the deepspeed launcher on the CPU accelerator that made each rank's all-reduce buffer in /dev/shm
    (about 66 MB), which a refused config must not leave behind."""
    port = free_port()
    cfg = {**json.loads((RECIPE / "ds_config.json").read_text()), "pipemorph": {"schedule": "zb", "shedule_hint": 1}}
    (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
    p = run_group([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), str(RECIPE / "train.py"), "--stages", "2",
                   "--steps", "1", "--config", str(tmp_path / "ds_config.json")], 600, cwd=tmp_path,
                  env={**os.environ, "DS_ACCELERATOR": "cpu"})
    output = p.stdout + p.stderr
    assert p.returncode == 2 and "error: ds_config pipemorph: unknown key 'shedule_hint'" in output, output[-3000:]
    assert "init_distributed" in (RECIPE / "train.py").read_text()  # the case this test is about
    assert sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")) == []
