"""The intra-op thread count a CPU rank gets when OMP_NUM_THREADS is unset: its share of the cores."""
from __future__ import annotations

import pytest

from ds_pipemorph.runtime.cpu_threads import choose_threads, local_ranks


@pytest.mark.parametrize("env,cores,threads", [
    ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),   # torchrun's variable; fewer cores than ranks: still one thread
    ({"LOCAL_SIZE": "4"}, 16, 4),        # the deepspeed launcher's variable
    ({"LOCAL_SIZE": "3"}, 8, 2),         # rounded down: 3 ranks x 2 threads on 8 cores
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 8, 4),
    ({}, 8, 8),                          # no launcher variable: one rank, every core
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "8"}, 8, 4),  # torchrun's wins
    ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "2"}, 8, 4),   # empty values are ignored
])
def test_each_rank_gets_cores_per_local_rank_and_at_least_one(env, cores, threads):
    choice = choose_threads(env, cores)
    assert choice is not None and choice.threads == threads and choice.cores == cores


def test_a_set_omp_num_threads_is_left_alone():
    assert choose_threads({"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "4"}, 16) is None


def test_the_log_line_names_cores_ranks_and_how_to_override():
    choice = choose_threads({"LOCAL_SIZE": "4"}, 2)
    assert local_ranks({"LOCAL_SIZE": "4"}) == (4, "LOCAL_SIZE")
    assert choice.describe() == ("OMP_NUM_THREADS is unset on a CPU accelerator: each of the 4 ranks on this host "
                                 "(LOCAL_SIZE) uses 1 intra-op thread (2 usable cores / 4, at least 1); set "
                                 "OMP_NUM_THREADS to choose")
    assert choose_threads({}, 8).describe() == ("OMP_NUM_THREADS is unset on a CPU accelerator: this rank, alone on "
                                                "its host, uses 8 intra-op threads (8 usable cores); set "
                                                "OMP_NUM_THREADS to choose")
