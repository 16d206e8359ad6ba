"""recipes/gpt: its byte corpus and windows, its tied embedding and head, and a short stock DeepSpeed
run on 2 CPU ranks (2 stages) whose training and validation losses fall from the uniform guess."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from deepspeed.pipe import TiedLayerSpec

from ds_pipemorph.procs import free_port, run_group

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "gpt"
UNIFORM = math.log(256)


def recipe_module(name: str):
    """One of the recipe's files as a module (the recipe is a directory of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpt_recipe_{name}", RECIPE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = recipe_module("data")
model = recipe_module("model")


@pytest.mark.timeout(60)
def test_windows_are_bytes_of_their_split_shifted_by_one_and_the_same_in_every_build():
    seq = 64
    a, b = data.ByteWindows("train", seq, 200), data.ByteWindows("train", seq, 200)
    text = bytes(a.bytes.tolist())
    starts = set()
    for i in range(0, 200, 9):
        x, y = a[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq,)
        assert 0 <= int(x.min()) and int(x.max()) <= 255
        assert torch.equal(x[1:], y[:-1])  # the targets are the inputs moved on by one byte
        assert bytes(x.tolist() + y[-1:].tolist()) in text  # one contiguous piece of the corpus
        x2, y2 = b[i]
        assert torch.equal(x, x2) and torch.equal(y, y2)  # seeded by index: every rank sees the same window
        starts.add(bytes(x.tolist()))
    assert len(starts) == len(range(0, 200, 9))  # different indices, different windows
    with pytest.raises(IndexError):
        a[200]


@pytest.mark.timeout(60)
def test_the_held_out_files_are_not_training_files_and_each_split_stays_within_a_few_mb():
    train, val = data.split_files("train"), data.split_files("val")
    assert train and val and not set(train) & set(val)
    assert all(p.suffix == ".py" and p.parent == data.stdlib_dir() for p in train + val)
    assert sum(p.stat().st_size for p in train) <= data.BUDGET["train"] <= 5_000_000
    assert sum(p.stat().st_size for p in val) <= data.BUDGET["val"]
    x, y = data.ByteWindows("val", 32, 4)[3]
    assert bytes(x.tolist() + y[-1:].tolist()) in bytes(data.corpus("val").tolist())


@pytest.mark.timeout(60)
def test_every_eighth_file_in_sorted_order_is_held_out(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_text(f"x = {i}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deeper.py").write_text("y = 1\n")  # not top level: never in the corpus
    val = [p.name for p in data.split_files("val", tmp_path)]
    train = [p.name for p in data.split_files("train", tmp_path)]
    assert val == ["m07.py", "m15.py"]
    assert train == [f"m{i:02d}.py" for i in range(20) if i not in (7, 15)]
    with pytest.raises(ValueError, match="split must be"):
        data.split_files("test", tmp_path)


@pytest.mark.timeout(60)
def test_the_first_and_last_layers_are_one_tied_embedding_and_only_blocks_are_checkpointable():
    specs = model.layer_specs(blocks=4)
    first, last = specs[0], specs[-1]
    assert isinstance(first, TiedLayerSpec) and isinstance(last, TiedLayerSpec)
    assert first.key == last.key == model.TIED_KEY and first.typename is last.typename is model.TokenEmbedding
    assert first.forward_fn is None and last.forward_fn is model.tied_head  # ids in, logits out
    assert first.tied_weight_attr == last.tied_weight_attr == ["weight"]
    assert [s.typename.__name__ for s in specs].count("Block") == 4
    assert model.CHECKPOINTABLE == ["Block"]


ONE_STAGE = textwrap.dedent("""
    import json, sys
    import deepspeed, torch, torch.nn.functional as F
    sys.path.insert(0, sys.argv[1])
    from model import TIED_KEY, gpt
    from ds_pipemorph.runtime.shutdown import exit_process

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    m = gpt(stages=1, d_model=32, heads=2, blocks=1, max_seq=16)
    embed, head = m.forward_funcs[0], m.forward_funcs[-1]
    tied = m.tied_modules[TIED_KEY]
    x = torch.randn(2, 16, 32)
    out = {"same_module": embed is tied and head.args[0] is tied,
           "head_is_embedding_weight": head.args[0].weight is embed.weight,
           "vocab_matrices": sum(p.shape == (256, 32) for p in m.parameters()),
           "logits_match": torch.equal(head(x), F.linear(x, embed.weight))}
    print("RESULT " + json.dumps(out), flush=True)
    exit_process(0)
""")


@pytest.mark.timeout(600)  # a fresh extension cache builds DeepSpeed's CPU collectives op first (about 40 s)
def test_a_one_stage_build_computes_its_logits_with_the_embedding_weight(tmp_path):
    script = tmp_path / "one_stage.py"
    script.write_text(ONE_STAGE)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    p = run_group([sys.executable, str(script), str(RECIPE)], 570, cwd=tmp_path, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, (p.stdout + p.stderr)[-4000:]
    assert json.loads(line[len("RESULT "):]) == {"same_module": True, "head_is_embedding_weight": True,
                                                 "vocab_matrices": 1, "logits_match": True}


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 30 s with DeepSpeed's CPU ops built; a fresh cache builds them first
def test_stock_deepspeed_trains_the_recipe_on_two_cpu_ranks_and_the_losses_fall(tmp_path):
    steps = 20
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(RECIPE / "train.py"), "--stock", "--stages", "2", "--steps", str(steps), "--log-every", "5",
           "--val-batches", "1"]
    p = run_group(cmd, 570, cwd=tmp_path, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    m = re.search(rf"^loss (\S+) -> (\S+) over {steps} steps .*\(stock DeepSpeed\)$", p.stdout, re.M)
    assert m, out[-4000:]
    first, last = float(m.group(1)), float(m.group(2))
    assert abs(first - UNIFORM) < 0.3  # an untrained model guesses about uniformly over the 256 bytes
    assert last < first - 1.5
    assert re.search(rf"^final train loss {last:.3f} \(uniform baseline ln 256 = 5\.545\)$", p.stdout, re.M)
    val = float(re.search(r"^validation loss (\S+) on held-out files$", p.stdout, re.M).group(1))
    assert val < first - 1.5
    # DeepSpeed's partition listing: the tied embedding opens stage 0 and closes stage 1 (the head).
    assert re.search(r"stage=0 layers=\d+\n\s+0: TokenEmbedding\n", p.stdout)
    assert re.search(r"stage=1 layers=\d+\n(\s+\d+: \w+\n)*\s+\d+: TokenEmbedding\n\s+loss: next_token_loss", p.stdout)
