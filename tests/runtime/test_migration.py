"""Live layer migration (``engine.repartition``): a run whose layers move between stages while it
trains equals a run that never moved them.

Each launch trains the same model on the same data twice: once on DeepSpeed's uniform partition
throughout, once moving layers at iteration boundaries (several layers at a time, towards the input
and towards the output, twice). Losses of every step and every parameter of the model (gathered
from all ranks by name: PipelineModule names a layer by its index in the model, wherever it runs)
must agree within 1e-5. Adam's moments and step counts travel with the layers, so any slip would
show in the steps after a move; with dropout and DeepSpeed's ``seed_layers`` so would the random
numbers a moved layer draws. The tied layer (first and last stage) stays where it is; moving it
is refused in one sentence, as is a layer skipping a stage.
"""
from __future__ import annotations

import pytest

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.partition.parts import layer_moves

from .launch import launch, launch_shared

TOL = 1e-5
PM = {"schedule": "zb", "timeout_s": 60}
# 18 layers: tied Linear, 8 x (Linear, GELU), tied Linear; DeepSpeed's uniform cut [0, 5, 10, 14, 18].
FIRST, SECOND = [0, 3, 10, 15, 18], [0, 6, 9, 15, 18]
SAVED = [0, 11, 13, 16, 18]  # the partition a checkpoint is saved on, after two migrations


def _model_params(run, name: str, ranks: list[int]) -> dict:
    """Every parameter of the model by name, from the ranks of one data-parallel replica."""
    out = {}
    for r in ranks:
        out.update(run.result(name, r)["params"])
    return out


def _assert_same_training(run, ref: str, moved: str, world: int, replica_ranks: list[list[int]]) -> None:
    for r in range(world):
        a, b = run.result(ref, r), run.result(moved, r)
        assert b["losses"] == pytest.approx(a["losses"], abs=TOL), f"rank {r}: losses differ after migrating"
    for ranks in replica_ranks:
        pa, pb = _model_params(run, ref, ranks), _model_params(run, moved, ranks)
        assert pa.keys() == pb.keys()
        worst = max((pa[k] - pb[k]).abs().max().item() for k in pa)
        assert worst <= TOL, f"replica {ranks}: parameters differ by {worst:g}"


def _both_ways_jobs() -> list[dict]:
    first, second = FIRST, SECOND
    base = {"stages": 4, "micro_batches": 4, "steps": 5, "tied": True, "pipemorph": PM}
    return [
        {**base, "name": "still"},
        {**base, "name": "moved", "migrate": {"1": first, "3": second}},
        {**base, "name": "still_torch", "torch_adam": True},
        {**base, "name": "moved_torch", "torch_adam": True, "migrate": {"2": first}},
        {**base, "name": "refused", "steps": 1, "migrate": {"0": [0, 5, 6, 7, 18]}},
        # Dropout after every GELU, with DeepSpeed's seed_layers (26 layers, uniform [0, 7, 14, 20, 26]):
        # a moved layer draws the same random numbers on its new stage.
        {**base, "name": "still_dropout", "dropout": 0.2},
        {**base, "name": "still_groups", "param_groups": True, "steps": 4},
        {**base, "name": "moved_groups", "param_groups": True, "steps": 4, "migrate": {"1": first, "2": second}},
        {**base, "name": "moved_dropout", "dropout": 0.2,
         "migrate": {"1": [0, 4, 14, 22, 26], "3": [0, 9, 12, 22, 26]}},
    ]


def _replicas_jobs() -> list[dict]:
    # 2 stages x 2 replicas: 10 layers (tied ends), uniform [0, 5, 10]. Ranks 0, 1 are stage 0 (replicas 0, 1).
    base = {"stages": 2, "dp": 2, "micro_batches": 4, "steps": 4, "tied": True, "pipemorph": PM}
    return [{**base, "name": "still"},
            {**base, "name": "moved", "migrate": {"1": [0, 3, 10], "2": [0, 7, 10]}}]


def _lost_transfer_jobs() -> list[dict]:
    # The first attempt's payloads are never sent (only their sizes): the receivers time out, every
    # rank votes no and keeps [0, 5, 10, 14, 18]; training goes on; the second attempt moves.
    pm = {**PM, "rebalance": {"timeout_s": 3}, "inject": {"migration_drop": [0]}}
    base = {"stages": 4, "micro_batches": 4, "steps": 4, "tied": True}
    return [{**base, "name": "still", "pipemorph": PM},
            {**base, "name": "retried", "pipemorph": pm,
             "migrate": {"1": [0, 3, 10, 15, 18], "2": [0, 3, 10, 15, 18]}}]


def _checkpoint_jobs() -> list[dict]:
    # Saved on SAVED after two migrations; a fresh engine (uniform [0, 5, 10, 14, 18]) cannot reach
    # it in one migration (layers 10 and 11 go from stage 2 to stage 0), so loading takes two, then
    # DeepSpeed loads each stage's optimizer state into the same layers it was saved from.
    base = {"stages": 4, "micro_batches": 4, "steps": 5, "tied": True, "pipemorph": PM}
    return [
        {**base, "name": "still"},
        {**base, "name": "saver", "migrate": {"1": [0, 9, 12, 15, 18], "2": SAVED}, "save": {"3": "ckpt"}},
        {**base, "name": "resumed", "load": {"dir": "ckpt", "step": 3}},
    ]


# The 4-rank tests' jobs in one launch (one start of the ranks and DeepSpeed), each test's in its own
# order; its ceiling is the sum of theirs as launches of their own (400, 400, 400, 280 s).
SHARED_TIMEOUT = 1480
TEST_TIMEOUT = SHARED_TIMEOUT + 60  # the first test to ask for the launch waits for all of it


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """A view per test of the launch."""
    return launch_shared(4, {"both_ways": _both_ways_jobs(), "replicas": _replicas_jobs(),
                             "lost": _lost_transfer_jobs(), "checkpoint": _checkpoint_jobs()},
                         tmp_path_factory.mktemp("migration"), timeout=SHARED_TIMEOUT)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_layers_moved_both_ways_on_four_stages_train_as_if_never_moved(four_ranks):
    second = SECOND
    run = four_ranks["both_ways"]
    _assert_same_training(run, "still", "moved", 4, [[0, 1, 2, 3]])
    _assert_same_training(run, "still_torch", "moved_torch", 4, [[0, 1, 2, 3]])
    _assert_same_training(run, "still_dropout", "moved_dropout", 4, [[0, 1, 2, 3]])
    _assert_same_training(run, "still_groups", "moved_groups", 4, [[0, 1, 2, 3]])  # two optimizer groups
    assert all(m["ok"] for m in run.result("moved_dropout", 2)["migrations"])
    for r in range(4):
        got = run.result("moved", r)
        assert [m["moved"] for m in got["migrations"]] == [[3, 4, 14], [3, 4, 5, 9]]
        assert all(m["ok"] for m in got["migrations"]) and got["parts"] == second
    # Bytes: stage 0 sent layers 3 (Linear 16x16: weight, bias, two Adam moments each) and 4 (GELU).
    sent = run.result("moved", 0)["migrations"][0]["sent"]
    assert sent >= 4 * (16 * 16 + 16) * 4
    assert run.result("moved", 1)["migrations"][0]["received"] == sent
    # Layers 7-13 would skip stage 2: refused on every rank before anything moved; training went on.
    for r in range(4):
        refused = run.result("refused", r)
        assert "layer 7 would move from stage 1 to stage 3" in refused["migrations"][0]["error"]
        assert refused["parts"] == [0, 5, 10, 14, 18] and len(refused["losses"]) == 1


@pytest.mark.timeout(TEST_TIMEOUT)
def test_two_pipelines_by_two_data_parallel_migrate_replicas_alike(four_ranks):
    run = four_ranks["replicas"]
    _assert_same_training(run, "still", "moved", 4, [[0, 2], [1, 3]])
    a, b = _model_params(run, "moved", [0, 2]), _model_params(run, "moved", [1, 3])
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0  # the replicas stay identical


@pytest.mark.timeout(420)
def test_gradient_clipping_after_a_move_scales_as_if_never_moved(tmp_path):
    # DeepSpeed's clip norm counts the gradients of one rank's parameters (stage 0's); with a limit
    # every step reaches, a move that changed what stage 0 holds would change every step's scale.
    base = {"stages": 2, "micro_batches": 4, "steps": 8, "tied": True, "gradient_clipping": 0.05, "pipemorph": PM}
    jobs = [{**base, "name": "still"},
            {**base, "name": "moved", "migrate": {"1": [0, 3, 10], "4": [0, 7, 10]}}]
    run = launch(2, jobs, tmp_path, timeout=400)
    assert [m["ok"] for m in run.result("moved", 0)["migrations"]] == [True, True]
    _assert_same_training(run, "still", "moved", 2, [[0, 1]])


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_transfer_lost_midway_keeps_the_old_partition_and_the_next_attempt_succeeds(four_ranks):
    run = four_ranks["lost"]
    _assert_same_training(run, "still", "retried", 4, [[0, 1, 2, 3]])
    for r in range(4):
        first, second = run.result("retried", r)["migrations"]
        assert not first["ok"] and first["after"] == [0, 5, 10, 14, 18]
        assert second["ok"] and second["after"] == [0, 3, 10, 15, 18]
    assert run.result("retried", 1)["migrations"][0]["reason"]  # the receiver says why it voted no


def test_a_tied_layer_is_not_moved():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    import torch

    from ds_pipemorph.runtime.migrate import check_movable

    specs = [LayerSpec(torch.nn.Linear, 2, 2), TiedLayerSpec("emb", torch.nn.Linear, 2, 2),
             LayerSpec(torch.nn.Linear, 2, 2), TiedLayerSpec("emb", torch.nn.Linear, 2, 2)]
    check_movable(specs, layer_moves([0, 2, 4], [0, 3, 4]), [0, 3, 4])  # layer 2 is not tied: allowed
    with pytest.raises(BadInput, match=r"layer 1 is tied \('emb'\); tied layers stay") as e:
        check_movable(specs, layer_moves([0, 2, 4], [0, 1, 4]), [0, 1, 4])
    assert "\n" not in str(e.value)


def test_moves_are_between_neighbouring_stages():
    assert layer_moves([0, 5, 10, 14, 18], [0, 3, 10, 15, 18]) == {3: (0, 1), 4: (0, 1), 14: (3, 2)}
    assert layer_moves([0, 2, 4], [0, 2, 4]) == {}
    with pytest.raises(BadInput, match="layer 4 would move from stage 1 to stage 3"):
        layer_moves([0, 2, 5, 8, 10], [0, 2, 3, 4, 10])
    with pytest.raises(BadInput, match="ends at 9 but the model has 10 layers"):
        layer_moves([0, 5, 10], [0, 5, 9])


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_checkpoint_saved_after_migrations_resumes_on_the_partition_it_was_saved_on(four_ranks):
    saved = SAVED
    run = four_ranks["checkpoint"]
    assert run.path("ckpt").joinpath("global_step3", "pipemorph_parts.json").is_file()
    for r in range(4):
        still, resumed = run.result("still", r), run.result("resumed", r)
        assert resumed["parts"] == saved
        assert resumed["moved_to"] == [[0, 9, 13, 16, 18], saved]  # inside load_checkpoint, in two steps
        assert resumed["losses"] == pytest.approx(still["losses"][3:], abs=TOL), f"rank {r}: losses differ after resuming"
    pa, pb = _model_params(run, "still", [0, 1, 2, 3]), _model_params(run, "resumed", [0, 1, 2, 3])
    assert pa.keys() == pb.keys()
    worst = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    assert worst <= TOL, f"parameters differ by {worst:g} after resuming"
