"""``runtime.parts_module``: a PipelineModule built on given parts (two CPU ranks over gloo) holds
exactly those stage boundaries and builds only its own stage's layers; bad parts are one sentence."""
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.procs import run_group

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.pipe import LayerSpec
    from ds_pipemorph.runtime.parts_module import PartsPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    layers = [LayerSpec(torch.nn.Linear, 4, 4) for _ in range(5)]
    out = {}
    pm = PartsPipelineModule(layers, parts=[0, 1, 5], loss_fn=torch.nn.MSELoss())
    out["list"] = [pm.parts, pm._local_start, pm._local_stop, len(list(pm.parameters()))]
    pm = PartsPipelineModule.from_parts_file(sys.argv[2], layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    out["file"] = [pm.parts, pm._local_start, pm._local_stop, len(list(pm.parameters()))]
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(320)
def test_a_pipeline_module_built_on_parts_holds_them(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    parts = tmp_path / "parts.yaml"
    parts.write_text(yaml.safe_dump({"version": 1, "parts": [0, 3, 5]}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "forkrun.py"), "2",
           str(tmp_path / "worker.py"), str(tmp_path), str(parts)]
    p = run_group(cmd, 300, cwd=REPO, env=env)
    got = {}
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), (p.stdout + p.stderr)[-4000:]
        got[rank] = json.loads(path.read_text())
    # parts [0, 1, 5]: stage 0 holds layer 0 (weight + bias), stage 1 layers 1-4.
    assert got[0]["list"] == [[0, 1, 5], 0, 1, 2] and got[1]["list"] == [[0, 1, 5], 1, 5, 8]
    assert got[0]["file"] == [[0, 3, 5], 0, 3, 6] and got[1]["file"] == [[0, 3, 5], 3, 5, 4]


def test_parts_that_do_not_fit_the_layers_are_one_sentence(tmp_path):
    from ds_pipemorph.runtime.parts_module import PartsPipelineModule

    with pytest.raises(BadInput, match="ends at 4 but the model has 5 layers"):
        PartsPipelineModule([object()] * 5, parts=[0, 2, 4])
    p = tmp_path / "parts.yaml"
    p.write_text(yaml.safe_dump({"parts": [0, 2, 4]}))
    with pytest.raises(BadInput, match=r"parts.yaml: parts: ends at 4 but the model has 5 layers") as e:
        PartsPipelineModule.from_parts_file(p, [object()] * 5)
    assert "\n" not in str(e.value)
