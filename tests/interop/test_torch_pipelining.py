"""PipeMorph plans exported for torch pipelining: torch's own loader accepts the CSV, and torch's
runtime (``_PipelineScheduleRuntime``, 4 ranks, gloo, CPU) runs it to the gradients a single
process computes for the same model and batch."""
import csv
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ds_pipemorph.plan.ir.ops import Op, format_stage, warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.warmup import adapted_warmup
from ds_pipemorph.plan.sim.validate import validate_schedule
from ds_pipemorph.procs import run_group
from ds_pipemorph_cli.app import app
from model_spec import batch, build_model, loss_fn

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
S, N = 4, 6


def plan_file(tmp_path: Path, schedule, name: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"version": 1, "stages": len(schedule), "microbatches": N,
                                 "warmup": warmup_counts(schedule), "schedule": [format_stage(r) for r in schedule]}))
    return p


def export(tmp_path: Path, plan: Path) -> Path:
    out = tmp_path / f"{plan.stem}.csv"
    r = CliRunner().invoke(app, ["export", str(plan), "--format", "torch-csv", "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def zb_plan():
    """The planner's Alg. 1 warm-up for 30 ms on link 0 (micro-batches in order on every stage)."""
    costs = Costs.uniform(S, 10.0, [30.0, 0.0, 0.0])
    return list_schedule(costs, N, adapted_warmup(costs, N, caps=[N] * S))


def shuffled_plan():
    """Stages 0-2 take micro-batches out of order (so a stage receives in another order than it
    computes, and stage 2 sends F1 before F0 to a last stage that needs F0 first); the last stage
    runs its forwards in order, as torch's runtime needs for its losses."""
    def row(f_order, bw):
        return [Op("F", m) for m in f_order] + [Op(k, m) for k, m in bw]

    sched = [
        row([1, 0, 3, 2, 5, 4], [(k, m) for m in (5, 4, 3, 2, 1, 0) for k in "BW"]),
        row([1, 0, 2, 3, 5, 4], [(k, m) for m in (2, 3, 0, 1, 4, 5) for k in "BW"]),
        row([1, 0, 2, 3, 4, 5], [("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("B", 3), ("W", 2),
                                 ("B", 4), ("W", 3), ("B", 5), ("W", 4), ("W", 5)]),
        [Op(k, m) for m in range(N) for k in "FBW"],
    ]
    validate_schedule(sched, S, N)
    return sched


def test_torch_loader_validates_the_exported_csv(tmp_path):
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    path = export(tmp_path, plan_file(tmp_path, zb_plan(), "zb"))
    with open(path, newline="") as f:  # what _PipelineScheduleRuntime._load_csv(format="compute_comms") does
        actions = {rank: [_Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(f))}
    assert _validate_schedule(actions, S, S, N) == {s: s for s in range(S)}  # stage s on rank s
    for rank, row in actions.items():
        kinds = [a.computation_type.value for a in row]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == N
        assert kinds.count("SEND_F") == kinds.count("RECV_B") == (N if rank < S - 1 else 0)
        assert kinds.count("SEND_B") == kinds.count("RECV_F") == (N if rank > 0 else 0)
        assert kinds.count("REDUCE_GRAD") == 1 and kinds.index("REDUCE_GRAD") == len(kinds) - 1


def reference():
    """Gradients and per-micro-batch losses of the whole model in one process (no pipelining)."""
    layers = build_model(S)
    x, y = batch(N)
    out = x
    for layer in layers:
        out = layer(out)
    loss_fn(out, y).backward()  # the mean over the batch = the mean of the micro-batch means
    losses = [loss_fn(o, t).item() for o, t in zip(out.detach().chunk(N), y.chunk(N))]
    return [{k: p.grad for k, p in layer.named_parameters()} for layer in layers], losses


PLANS = {"zb": zb_plan, "out-of-order": shuffled_plan}
TIMEOUT = 560  # both schedules in one launch: the sum of their ceilings as launches of their own (280 s each)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """Every plan exported and run by torch pipelining in one launch: name -> its ranks' output folder."""
    tmp = tmp_path_factory.mktemp("torch_pipelining")
    args, outs = [], {}
    for name, make in PLANS.items():
        path = export(tmp, plan_file(tmp, make(), make.__name__))
        outs[name] = tmp / f"out_{make.__name__}"
        outs[name].mkdir()
        args += [str(path), str(outs[name])]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={S}",
           str(HERE / "torch_pipelining_worker.py"), args[0], str(N), *args[1:]]
    p = run_group(cmd, TIMEOUT, cwd=REPO, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return outs


@pytest.mark.timeout(TIMEOUT + 60)  # the first test to ask for the launch waits for all of it
@pytest.mark.parametrize("name", list(PLANS))
def test_torch_pipelining_runs_an_exported_plan_to_single_process_gradients(pipelined, name):
    out = pipelined[name]
    grads, losses = reference()
    for rank in range(S):
        got = torch.load(out / f"rank{rank}.pt")
        assert got["grads"].keys() == grads[rank].keys()
        for k, g in grads[rank].items():
            assert torch.allclose(got["grads"][k], g, rtol=0, atol=1e-5), f"rank {rank} {k}"
    assert torch.tensor(torch.load(out / f"rank{S - 1}.pt")["losses"]).allclose(torch.tensor(losses), atol=1e-6)
