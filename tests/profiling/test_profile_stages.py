"""`pipemorph profile-stages` on tiny models: the profile loads with `Profile`, times are positive and a
bigger stage takes longer; the PipelineModule's own partition is used; --merge keeps links_ms."""
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ds_pipemorph.fileio import load_model
from ds_pipemorph.plan.ir.profile import Profile
from ds_pipemorph.profiling.pipecapture import build_stages
from ds_pipemorph.profiling.stages import profile_stages

from ds_pipemorph_cli.app import app

HERE = Path(__file__).resolve().parent
runner = CliRunner()


@pytest.fixture(autouse=True)
def _models_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def totals(prof: Profile) -> list[float]:
    c = prof.compute_ms
    return [f + b + w for f, b, w in zip(c.forward, c.backward_input, c.backward_weight)]


@pytest.mark.timeout(300)
def test_pipeline_module_profile_loads_and_the_wider_stage_is_slower(tmp_path):
    out = tmp_path / "profile.yaml"
    r = run("profile-stages", "--model", "toy_models:pipe_two_stages", "--sample", "toy_models:sample",
            "--threads", "1", "--reps", "7", "-o", out)
    assert r.exit_code == 0, r.output
    assert "0-1" in r.output and "2-3" in r.output and "split: runtime" in r.output  # DeepSpeed's uniform partition
    prof = load_model(out, Profile)
    assert prof.stages == 2 and prof.microbatches == 8 and prof.links_ms == [0.0]
    c = prof.compute_ms
    assert all(t > 0 for t in c.forward + c.backward_input + c.backward_weight)
    assert c.forward[1] > c.forward[0]
    assert c.backward_input[1] + c.backward_weight[1] > c.backward_input[0] + c.backward_weight[0]
    # The first stage's input is data (no gradient): its backward is nearly all W.
    assert c.backward_weight[0] > c.backward_input[0]
    # Saved for B, one micro-batch of 64 x 64 floats: each Mlp keeps its input (16 KiB, for the weight
    # gradient of `up`) and its ReLU output (64 x hidden floats, for ReLU's and `down`'s backward);
    # the last stage's MSE keeps the output and the labels (16 KiB each).
    x, mib = 64 * 64 * 4, 1024 * 1024
    want = [2 * (x + 64 * 64 * 4), 2 * (x + 64 * 2048 * 4) + 2 * x]
    assert prof.memory.activation_mb == pytest.approx([w / mib for w in want], abs=1e-4)
    assert prof.memory.capacity_mb == pytest.approx([2 * want[0] / mib, want[1] / mib], abs=1e-4)  # stock 1F1B: S - s
    assert all(0 < w <= a for w, a in zip(prof.memory.weight_mb, prof.memory.activation_mb))


@pytest.mark.timeout(300)
def test_stage_list_with_autograd_split_merges_into_a_links_part(tmp_path):
    part = tmp_path / "links.yaml"
    part.write_text("stages: 3\nlinks_ms: [0, 30]\n")
    r = run("profile-stages", "--model", "toy_models:stage_list", "--input-shape", "64,64", "--threads", "1",
            "--split", "autograd", "--merge", part, "--microbatches", "9")
    assert r.exit_code == 0, r.output
    prof = load_model(part, Profile)  # the part became a complete profile, in place
    assert prof.links_ms == [0, 30] and prof.microbatches == 9
    t = totals(prof)
    assert 0 < t[0] < t[1] < t[2], t


@pytest.mark.timeout(300)
def test_runtime_split_matches_autograd_gradients_and_reports_times():
    torch.manual_seed(0)
    modules, loss_fn, parts = build_stages(__import__("toy_models").pipe_two_stages)
    assert parts == [0, 2, 4] and loss_fn is torch.nn.functional.mse_loss
    x, y = __import__("toy_models").sample()
    times, used = profile_stages(modules, x, y, loss_fn, warmup=1, reps=2)
    assert used == "runtime" and len(times) == 2
    assert times[1].params > times[0].params
    # W left the parameter gradients of the last timed round: compare with a fused backward.
    got = [p.grad.clone() for p in modules[1].parameters()]
    h = modules[0](x).detach()
    for p in modules[1].parameters():
        p.grad = None
    loss_fn(modules[1](h), y).backward()
    for g, p in zip(got, modules[1].parameters()):
        assert torch.allclose(g, p.grad, atol=1e-5)
