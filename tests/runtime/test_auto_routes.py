"""``delegation.mode: auto`` with one slow link: only that link moves to the delegates.

4 emulated stages x 12 micro-batches of 1 MiB activations, 20 ms injected on link 0 (gloo). The
injector holds link 0's sender for the delay (NCCL's blocking send); links 1 and 2 go out by gloo's
isend, whose sender never waits. The engine models each direct link as its own sends behave, on
every rank alike, so the control loop moves link 0 to the delegates and keeps links 1 and 2 direct,
also where their messages are measured slow (a 1 MiB message takes a few ms to cross a loaded
host; a delegate would add copies and nothing the wire does not give). Training equals stock DeepSpeed's.
"""
from __future__ import annotations

import pytest

from .launch import launch, max_param_diff

S, N, STEPS = 4, 12, 5
ROWS = 1 << 14  # x 16 floats: 1 MiB per micro-batch
MODEL = {"stages": S, "micro_batches": N, "steps": STEPS, "model": "emulated", "layers": S, "layer_ms": 5,
         "micro_batch_size": ROWS}
SECTION = {"schedule": "adaptive", "delegation": {"mode": "auto"}, "nvtx": False,
           "max_exchange_gap": 1, "inject": {"links": {"0": {"delay_ms": 20}}}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_20ms_on_link_0_delegates_link_0_only_and_training_equals_stock(tmp_path):
    run = launch(S, [{"name": "stock", **MODEL, "pipemorph": None}, {"name": "auto", **MODEL, "pipemorph": SECTION}],
                 tmp_path, timeout=560)
    assert run.returncode == 0, run.output[-4000:]
    for r in range(S):
        ours, stock = run.result("auto", r), run.result("stock", r)
        # Every rank models link 0 as a blocked sender and links 1 and 2 as one FIFO each.
        assert ours["direct_model"] == ["direct", "delegated(1)", "delegated(1)"], (r, ours["direct_model"])
        # Re-planned for link 0's delay (at least the 20 ms injected), the same on every rank.
        assert ours["replan_links"] and ours["replan_links"] == run.result("auto", 0)["replan_links"]
        assert ours["replan_links"][-1][0] >= 20
        # At the end, on each of its links (stage r is an end of links r - 1 and r): link 0 delegated,
        # links 1 and 2 direct, whatever delay they were planned for.
        for link in {r - 1, r} & set(range(S - 1)):
            assert ours["link_modes"][link] == ("delegated" if link == 0 else "direct"), \
                (r, ours["link_modes"], ours["replan_links"])
        assert ours["losses"] == pytest.approx(stock["losses"], abs=1e-5)
        assert max_param_diff(ours, stock) <= 1e-5
