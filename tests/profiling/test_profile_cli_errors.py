"""Bad input to `profile-links` and `profile-stages`: one sentence, exit code 2, no output file."""
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ds_pipemorph_cli.app import app

HERE = Path(__file__).resolve().parent
runner = CliRunner()

THREE_STAGES_THREE_LINKS = {
    "stages": 3, "microbatches": 6,
    "compute_ms": {"forward": 1, "backward_input": 1, "backward_weight": 1},
    "links_ms": [0, 0, 30],
}


@pytest.fixture(autouse=True)
def _plain_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.syspath_prepend(str(HERE))


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_sentence(r, needle):
    assert r.exit_code == 2, r.output
    assert needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,env,needle", [
    (["--inject-links-ms", "0,x,30"], {}, "--inject-links-ms: '0,x,30' is not a comma-separated list"),
    (["--inject-links-ms", "0,-1,30"], {}, "is negative"),
    (["--inject-links-ms", "0,0,30"], {"WORLD_SIZE": "2"}, "--inject-links-ms: expected 1 values (one per link of 2 ranks), got 3"),
    (["--sizes", "4K,12Q"], {}, "--sizes: '12Q' is not a message size"),
    ([], {}, "needs one process per stage"),
    ([], {"WORLD_SIZE": "4"}, "RANK, MASTER_ADDR, MASTER_PORT not set"),
])
def test_profile_links_bad_options(tmp_path, monkeypatch, args, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "links.yaml"
    one_sentence(run("profile-links", "--out", out, *args), needle)
    assert not out.exists()


@pytest.mark.timeout(60)
def test_profile_links_refuses_a_merge_profile_with_3_links_for_3_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(THREE_STAGES_THREE_LINKS))
    before = prof.read_text()
    out = tmp_path / "out.yaml"
    one_sentence(run("profile-links", "--merge", prof, "--out", out),
                 "links_ms: expected 2 values (one per link between 3 stages), got 3")
    assert not out.exists() and prof.read_text() == before


@pytest.mark.timeout(60)
def test_profile_links_refuses_a_merge_profile_for_another_stage_count(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(dict(THREE_STAGES_THREE_LINKS, links_ms=[0, 0])))
    one_sentence(run("profile-links", "--merge", prof), "the profile has 3 stages, this job (4 ranks) has 4")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,needle", [
    (["--model", "no_such_module_xyz:build", "--input-shape", "8,64"], "--model: cannot import 'no_such_module_xyz'"),
    (["--model", "toy_models:no_such_function", "--input-shape", "8,64"], "'toy_models' has no function 'no_such_function'"),
    (["--model", "toy_models", "--input-shape", "8,64"], "is not module:function"),
    (["--model", "toy_models:not_a_model", "--input-shape", "8,64"], "expected a deepspeed.pipe.PipelineModule or a list"),
    (["--model", "toy_models:stage_list", "--input-shape", "8,x"], "--input-shape: '8,x' is not"),
    (["--model", "toy_models:stage_list", "--input-shape", "8,32"], "stage 0 failed on its sample input"),
    (["--model", "toy_models:stage_list"], "give exactly one of --input-shape and --sample"),
    (["--model", "toy_models:stage_list", "--input-shape", "8,64", "--split", "fast"], "--split: 'fast'"),
])
def test_profile_stages_bad_input(tmp_path, args, needle):
    out = tmp_path / "p.yaml"
    one_sentence(run("profile-stages", "-o", out, *args), needle)
    assert not out.exists()


@pytest.mark.timeout(120)
def test_profile_stages_refuses_a_merge_profile_with_3_links_for_3_stages(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(THREE_STAGES_THREE_LINKS))
    before = prof.read_text()
    out = tmp_path / "out.yaml"
    one_sentence(run("profile-stages", "--model", "toy_models:stage_list", "--input-shape", "8,64",
                     "--merge", prof, "-o", out), "links_ms: expected 2 values")
    assert not out.exists() and prof.read_text() == before
