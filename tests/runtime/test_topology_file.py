"""The topology file as a DeepSpeed ProcessTopology (pure: no process group needed)."""
import pytest
import yaml

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.plan.place.placement import Placement
from ds_pipemorph.runtime.topology_file import PlacedTopology, load_topology, process_topology

topology = pytest.importorskip("deepspeed.runtime.pipe.topology")

CUSTOM = [[0, 4], [2, 6], [1, 5], [3, 7]]  # ranks[stage][replica]


def write(tmp_path, ranks, dims):
    p = tmp_path / "topology.yaml"
    p.write_text(yaml.safe_dump({"version": 1, "axes": ["pipe", "data"], "dims": dims, "ranks": ranks}))
    return p


@pytest.mark.parametrize("pp,dp", [(4, 2), (2, 4), (1, 3), (3, 1)])
def test_default_placement_is_deepspeeds_own_topology(tmp_path, pp, dp):
    topo = load_topology(write(tmp_path, Placement.default(pp, dp).as_lists(), [pp, dp]))
    stock = topology.PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    assert type(topo) is topology.PipeDataParallelTopology
    assert topo.mapping == stock.mapping
    # the subclass, given the default grid, agrees with DeepSpeed as well
    placed = PlacedTopology(Placement.default(pp, dp).as_lists())
    assert list(placed.mapping.items()) == list(stock.mapping.items())
    for axis in ("pipe", "data"):
        assert placed.get_axis_comm_lists(axis) == stock.get_axis_comm_lists(axis)


def test_custom_placement_maps_stage_and_replica_to_the_files_rank(tmp_path):
    topo = load_topology(write(tmp_path, CUSTOM, [4, 2]))
    assert isinstance(topo, PlacedTopology) and isinstance(topo, topology.PipeDataParallelTopology)
    assert topo.get_dim("pipe") == 4 and topo.get_dim("data") == 2 and topo.world_size() == 8
    for s in range(4):
        for r in range(2):
            rank = CUSTOM[s][r]
            assert topo.get_rank(pipe=s, data=r) == rank
            c = topo.get_coord(rank)
            assert (c.pipe, c.data) == (s, r)
            assert topo.filter_match(pipe=s, data=r) == [rank]
    assert topo.get_axis_comm_lists("data") == CUSTOM  # data-parallel groups: one per stage
    assert topo.get_axis_comm_lists("pipe") == [[0, 2, 1, 3], [4, 6, 5, 7]]  # one pipeline per replica
    assert topo.get_axis_list("data", 1) == [4, 6, 5, 7]


class FakeComm:
    """What PipelineParallelGrid asks of deepspeed.comm, for one rank of an 8-rank job."""

    def __init__(self, rank):
        self.rank = rank

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return 8

    def new_group(self, ranks):
        return tuple(sorted(ranks))


def test_deepspeeds_grid_builds_groups_from_the_file(tmp_path, monkeypatch, capsys):
    topo = load_topology(write(tmp_path, CUSTOM, [4, 2]))
    for rank in range(8):
        monkeypatch.setattr(topology, "dist", FakeComm(rank))
        grid = topology.PipelineParallelGrid(topology=topo)
        s = next(s for s in range(4) if rank in CUSTOM[s])
        r = CUSTOM[s].index(rank)
        assert (grid.get_stage_id(), grid.get_data_parallel_id()) == (s, r)
        assert grid.dp_group == CUSTOM[s]
        assert grid.pp_group == [row[r] for row in CUSTOM]
        assert grid.p2p_groups[rank] == [rank, CUSTOM[(s + 1) % 4][r]]
        if s < 3:
            assert grid.stage_to_global(stage_id=s + 1) == CUSTOM[s + 1][r]
    capsys.readouterr()


@pytest.mark.parametrize("ranks,dims,needle", [
    ([[0, 1], [2, 2]], [2, 2], "rank 3 is missing"),
    ([[0, 1], [2, 3]], [2, 3], "expected 2 rows"),
])
def test_bad_topology_files_are_one_sentence(tmp_path, ranks, dims, needle):
    with pytest.raises(BadInput, match=needle):
        load_topology(write(tmp_path, ranks, dims))
    with pytest.raises(BadInput, match="no such file"):
        load_topology(tmp_path / "missing.yaml")


def test_placed_topology_rejects_a_grid_without_every_rank():
    with pytest.raises(ValueError, match="every rank"):
        PlacedTopology([[0, 1], [1, 2]])
    assert process_topology(Placement.from_ranks(CUSTOM)).mapping == PlacedTopology(CUSTOM).mapping
