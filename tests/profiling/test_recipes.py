"""recipes/gpt, recipes/gpu_cluster, recipes/stragglers and recipes/tiny_gpt: configs the engine accepts with no
setting it would ignore, docs in sync with them, traces that load."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from ds_pipemorph.inject.section import InjectConfig
from ds_pipemorph.inject.delays import load_trace
from ds_pipemorph.runtime.config import PipeMorphConfig, parse_config, pending_notes
from ds_pipemorph.runtime.assembly import nccl_rules

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "recipes" / "gpu_cluster"
STRAG = ROOT / "recipes" / "stragglers"
SHIPPED = sorted((ROOT / "recipes").glob("*/ds_config*.json")) + sorted((ROOT / "recipes").glob("*/ds_config*.jsonc"))


def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of the pipemorph section, leaves only (``inject.links`` counts as a leaf; the
    ``inject`` section's model is the injection plug-in's)."""
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and name != "inject":
            out += keys(sub, f"{prefix}{name}.")
        elif name == "inject":
            out += [f"inject.{k}" for k in InjectConfig.model_fields]
        else:
            out.append(prefix + name)
    return out


@pytest.mark.timeout(30)
def test_gpu_cluster_config_is_accepted_and_its_commented_copy_matches():
    cfg = json.loads((GPU / "ds_config.json").read_text())
    parsed = parse_config(cfg["pipemorph"])
    # The README's promise: the control loop re-plans and delegates a slow link; the other links stay
    # direct, under NCCL's point-to-point rules on the NCCL backend.
    assert (parsed.schedule, parsed.adapt.enabled, parsed.delegation.mode) == ("adaptive", True, "auto")
    assert nccl_rules("nccl", parsed.delegation.mode) and not nccl_rules("gloo", parsed.delegation.mode)
    jsonc = re.sub(r"//[^\n]*", "", (GPU / "ds_config.commented.jsonc").read_text())
    assert json.loads(jsonc) == cfg
    # Every key (and every default) is in the README table and has a comment in the jsonc copy.
    readme = (GPU / "README.md").read_text()
    defaults = PipeMorphConfig().model_dump()
    for key in keys(PipeMorphConfig):
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"README.md has no row for {key}"
        value = defaults
        for part in key.split("."):
            value = value[part]
        assert f"`{json.dumps(value)}`" in row, (key, value, row)
    assert set(json.loads(jsonc)["pipemorph"]) == set(PipeMorphConfig.model_fields)


@pytest.mark.timeout(30)
def test_gpu_cluster_config_runs_as_it_is_with_tensor_parallelism():
    """launch.sh's TP=2 trains the template unchanged: DeepSpeed reads its whole-activation settings, and
    the engine's tensor-parallel check (``runtime.tensor_parallel.refusal``) passes it, where DeepSpeed's
    default (partitioned) would be refused."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import get_pipeline_config

    from ds_pipemorph.runtime.compat import TP_PARTITIONED_REFUSED
    from ds_pipemorph.runtime.tensor_parallel import refusal

    cfg = json.loads((GPU / "ds_config.json").read_text())
    grid = SimpleNamespace(get_slice_parallel_world_size=lambda: 2)
    model = SimpleNamespace(mpu=lambda: grid)  # what refusal reads of a PipelineModule: its grid
    pm = parse_config(cfg["pipemorph"])
    pipeline = get_pipeline_config(cfg)
    assert (pipeline["pipe_partitioned"], pipeline["grad_partitioned"]) == (False, False)
    assert refusal(SimpleNamespace(pipeline=pipeline), model, pm) is None
    stock_default = get_pipeline_config({k: v for k, v in cfg.items() if k != "pipeline"})
    assert refusal(SimpleNamespace(pipeline=stock_default), model, pm) == TP_PARTITIONED_REFUSED


@pytest.mark.timeout(30)
def test_launch_script_parses():
    assert subprocess.run(["bash", "-n", str(GPU / "launch.sh")]).returncode == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["ds_config.static.json", "ds_config.dynamic.json"])
def test_straggler_configs_are_accepted_and_their_trace_loads(name):
    pm = parse_config(json.loads((STRAG / name).read_text())["pipemorph"])
    if pm.inject.trace:
        tr = load_trace(str(STRAG / pm.inject.trace), 3)  # relative paths are read against the config's directory
        assert tr.points[0].t == 0.0 and len(tr.points) > 100
    else:
        assert pm.inject.links["2"].delay_ms == 30


@pytest.mark.timeout(30)
def test_shipped_traces_load_for_four_stages():
    for path in sorted(STRAG.glob("trace_*.yaml")):
        tr = load_trace(str(path), 3)
        assert all(c >= 0 for p in tr.points for c in p.links_ms)


def test_every_shipped_ds_config_is_read_by_deepspeed_and_sets_nothing_the_engine_ignores():
    from ds_pipemorph.runtime.initialize import load_config

    assert {p.parent.name for p in SHIPPED} == {"gpt", "gpu_cluster", "stragglers", "tiny_gpt"}
    for path in SHIPPED:  # DeepSpeed reads files as HJSON: the commented copy is a valid config too
        cfg = load_config(str(path))
        pm = parse_config(cfg["pipemorph"])
        assert pending_notes(pm) == [], path.name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["adaptive", "plan"])
def test_launch_scripts_train_config_sets_nothing_the_engine_ignores(tmp_path, schedule):
    # The config launch.sh's train step writes, from its own embedded script.
    script = re.search(r"<<'PY'\n(.*?)\nPY\n", (GPU / "launch.sh").read_text(), re.S).group(1)
    subprocess.run([sys.executable, "-c", script, str(GPU / "ds_config.json"), str(tmp_path), schedule], check=True)
    pm = parse_config(json.loads((tmp_path / "ds_config.json").read_text())["pipemorph"])
    assert pending_notes(pm) == []
    if schedule == "plan":
        assert (pm.schedule, pm.plan_file, pm.delegation.mode) == ("plan", f"{tmp_path}/plan.yaml", "off")
    else:
        assert (pm.schedule, pm.profile_out) == ("adaptive", f"{tmp_path}/measured_profile.yaml")
