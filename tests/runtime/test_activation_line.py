"""The start-up log line of what the first iteration measured (``runtime.act_bytes``)."""
from __future__ import annotations

import pytest

from ds_pipemorph.plan.ir.memory import MemoryBudget
from ds_pipemorph.runtime.act_bytes import MIB, ActivationBytes, describe_activation_bytes


def _two_stages(checkpointed: bool) -> list[ActivationBytes]:
    # Stage s of 2 holds 2 - s micro-batches of f under stock 1F1B.
    return [ActivationBytes(0, f=4 * MIB, w=4 * MIB, grads=MIB // 10, peak=9 * MIB, stock=8 * MIB,
                            checkpointed=checkpointed),
            ActivationBytes(1, f=2 * MIB, w=2 * MIB, grads=0, peak=3 * MIB, stock=2 * MIB, checkpointed=checkpointed)]


@pytest.mark.timeout(10)
def test_the_line_names_stock_s_figure_and_on_a_checkpointed_job_the_recomputation_it_leaves_out():
    plain = describe_activation_bytes(_two_stages(False))
    assert plain == ("pipemorph: activation memory in iteration 1, MiB per stage: F keeps [4.0, 2.0] per micro-batch "
                     "for B, B keeps [4.0, 2.0] for W plus [0.1, 0.0] of gradients; the most held at once "
                     "[9.0, 3.0] (stock 1F1B: [8.0, 2.0]); no memory budget")
    checkpointed = describe_activation_bytes(_two_stages(True))
    assert checkpointed == plain.replace("(stock 1F1B: [8.0, 2.0])", "(stock 1F1B: [8.0, 2.0], plus one checkpointed "
                                         "chunk recomputed at a time in each backward)")


@pytest.mark.timeout(10)
def test_with_a_budget_the_line_gives_it_in_mib_and_in_micro_batches():
    # 1.5x stock's units: [3, 1.5] micro-batches of [4, 2] MiB = [12, 3] MiB.
    line = describe_activation_bytes(_two_stages(False), budget=MemoryBudget(caps=(3, 1), units=(3.0, 1.5)))
    assert line.endswith("; the budget from now on (memory.budget): [12.0, 3.0] MiB per stage, [3, 1.5] "
                         "micro-batches' activations")
