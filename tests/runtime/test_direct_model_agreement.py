"""Every rank's control loop must model direct links alike: each plans from the same gathered table,
and ranks that disagreed would disagree on whether a decision is due (and wait in different
collectives). The engine takes the blocking model when any rank's direct sends block."""
import os
import sys
from pathlib import Path

import pytest

from ds_pipemorph.procs import run_group

WORKER = '''
import sys, types
import torch.distributed as dist
from ds_pipemorph.runtime.engine import PipeMorphEngine

dist.init_process_group("gloo")
rank = dist.get_rank()
waits = [w == "1" for w in sys.argv[1].split(",")]
fake = types.SimpleNamespace(num_stages=2,
                             transport=types.SimpleNamespace(direct=types.SimpleNamespace(sender_waits=waits[rank])))
with open(f"model.rank{rank}", "w") as f:  # a file per rank: the ranks' stdout interleaves
    f.write(str(PipeMorphEngine._direct_link_model(fake)))
dist.destroy_process_group()
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("waits,model", [("0,0", "delegated(1)"), ("0,1", "direct"), ("1,0", "direct"), ("1,1", "direct")])
def test_the_direct_link_model_is_the_blocking_one_on_every_rank_if_any_rank_blocks(tmp_path, waits, model):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = run_group([sys.executable, str(repo / "tests" / "runtime" / "forkrun.py"), "2", str(script), waits],
                  150, cwd=tmp_path, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert [(tmp_path / f"model.rank{r}").read_text() for r in (0, 1)] == [model, model]
