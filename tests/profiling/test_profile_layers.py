"""Per-layer profiling (`profile-stages --per-layer`, `profiling.layers`) on Linear layers of two
widths 32x apart: the wider layer's forward is slower, sizes and parameter counts are the derived
ones, the file is a layer profile that `pipemorph partition` reads; bad input is one sentence."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.partition.layer_profile import read_layer_profile
from ds_pipemorph.profiling.layers import layer_profile_data, profile_layers, write_layer_profile

from ds_pipemorph_cli.app import app

HERE = Path(__file__).resolve().parent
runner = CliRunner()
MB = 2 ** 20


@pytest.fixture(autouse=True)
def _models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
def lm():
    """The models module, with torch on one thread as a training rank is (torchrun sets
    OMP_NUM_THREADS=1): on a shared machine, threads waiting for each other blur the times."""
    import layer_models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield layer_models
    torch.set_num_threads(threads)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def expected(lm):
    """Sizes and counts derived from the shapes: float32, batch x width per output."""
    n, w, B = lm.NARROW, lm.WIDE, lm.BATCH
    params = [n * n + n, n * w + w, 0, w * n + n]
    act = [B * n * 4 / MB, B * w * 4 / MB, B * w * 4 / MB, B * n * 4 / MB]
    return params, act


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["runtime", "autograd"])
def test_layer_costs_are_ordered_and_sizes_are_the_derived_ones(lm, split):
    torch.manual_seed(0)
    x, y = lm.sample()
    costs, used = profile_layers(lm.layers(), x, y, torch.nn.functional.mse_loss, warmup=2, reps=9, split=split)
    assert used == split and [c.name for c in costs] == ["Linear", "Linear", "relu", "Linear"]
    params, act = expected(lm)
    B, n, w = lm.BATCH, lm.NARROW, lm.WIDE
    assert [c.params for c in costs] == params
    assert [c.activation_mb for c in costs] == act
    assert [c.gradient_mb for c in costs] == act  # every output is float and gets a gradient
    assert [c.memory_mb for c in costs] == [4 * p * 4 / MB for p in params]  # params, grads, Adam's 2 moments
    # Saved for backward: each Linear its input (its weight is a parameter, in memory_mb), the ReLU
    # its output, the loss its input and target.
    assert [c.stash_mb for c in costs] == [B * n * 4 / MB, B * n * 4 / MB, B * w * 4 / MB, (B * w + 2 * B * n) * 4 / MB]
    f = [c.forward_ms for c in costs]
    assert f[1] > f[0] and f[3] > f[0], f  # 32x the multiply-adds
    assert all(c.forward_ms > 0 and c.backward_input_ms >= 0 and c.backward_weight_ms >= 0 for c in costs)
    assert costs[1].backward_weight_ms > 0 and costs[3].backward_input_ms > 0
    assert costs[2].backward_weight_ms < costs[2].backward_input_ms  # the ReLU has no weights
    assert costs[0].backward_input_ms < costs[0].backward_weight_ms  # its input is data: no B to speak of


@pytest.mark.timeout(120)
def test_a_function_on_data_has_forward_only(tmp_path, lm):
    x = torch.randn(8, lm.NARROW)
    costs, _ = profile_layers([lambda t: t * 2, torch.nn.Linear(lm.NARROW, 4)], x, warmup=1, reps=3)
    assert costs[0].backward_input_ms == 0 and costs[0].backward_weight_ms == 0 and costs[0].forward_ms > 0
    assert costs[0].gradient_mb == 0 and costs[0].activation_mb == 8 * lm.NARROW * 4 / MB
    assert costs[1].params == lm.NARROW * 4 + 4
    data = layer_profile_data(costs, 2, 3)
    assert data["layers"]["param_count"] == [0, lm.NARROW * 4 + 4] and data["microbatches"] == 3
    write_layer_profile(tmp_path / "l.yaml", data)
    assert read_layer_profile(tmp_path / "l.yaml").layers.backward_input_ms[0] == 0
    with pytest.raises(BadInput, match="2 layers cannot fill 3 stages"):
        layer_profile_data(costs, 3, 3)


@pytest.mark.timeout(300)
def test_per_layer_cli_writes_a_layer_profile_that_partition_reads(tmp_path, lm):
    out, parts = tmp_path / "layers.yaml", tmp_path / "parts.yaml"
    r = run("profile-stages", "--model", "layer_models:two_widths", "--sample", "layer_models:sample",
            "--per-layer", "--threads", "1", "--reps", "7", "-o", out)
    assert r.exit_code == 0, r.output
    assert "4 layers" in r.output and "split: runtime" in r.output and f"wrote {out}" in r.output
    lp = read_layer_profile(out)
    assert lp.stages == 2 and lp.microbatches == 8  # the PipelineModule's stages, 4 x stages micro-batches
    params, act = expected(lm)
    assert lp.layers.param_count == params and lp.layers.activation_mb == act
    assert lp.layers.forward_ms[1] > lp.layers.forward_ms[0], lp.layers.forward_ms
    r = run("partition", out, "-o", parts)
    assert r.exit_code == 0, r.output
    got = yaml.safe_load(parts.read_text())["parts"]
    assert got[0] == 0 and got[-1] == 4 and len(got) == 3


@pytest.mark.timeout(300)
def test_per_layer_cli_takes_stages_and_microbatches_for_a_list_of_layers(tmp_path):
    out = tmp_path / "layers.json"
    r = run("profile-stages", "--model", "layer_models:layer_list", "--input-shape", "16,64", "--per-layer",
            "--stages", "3", "--microbatches", "6", "--reps", "2", "--warmup", "1", "-o", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["stages"] == 3 and data["microbatches"] == 6 and len(data["layers"]["forward_ms"]) == 4
    assert read_layer_profile(out).num_layers == 4
    r = run("partition", out, "--time-limit", "0.5", "--budget", "0.05")
    assert r.exit_code == 0, r.output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,needle", [
    (["--model", "no_such_module_xyz:build", "--input-shape", "8,64"], "--model: cannot import 'no_such_module_xyz'"),
    (["--model", "layer_models:two_widths", "--input-shape", "8,64", "--stages", "5"],
     "the model has 4 layers, too few for 5 stages"),
    (["--model", "layer_models:layer_list", "--input-shape", "8,64"], "--per-layer: give --stages"),
    (["--model", "layer_models:two_widths", "--input-shape", "8,32"], "layer 0 (Linear) failed on its sample input"),
    (["--model", "layer_models:two_widths", "--input-shape", "8,64", "--merge", "p.yaml"], "--merge replaces"),
])
def test_per_layer_bad_input(tmp_path, args, needle):
    out = tmp_path / "layers.yaml"
    r = run("profile-stages", "--per-layer", "-o", out, *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


@pytest.mark.timeout(120)
def test_stages_without_per_layer_is_refused(tmp_path):
    out = tmp_path / "p.yaml"
    r = run("profile-stages", "--model", "layer_models:two_widths", "--input-shape", "8,64", "--stages", "2", "-o", out)
    assert r.exit_code == 2 and "--stages is for --per-layer" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()
