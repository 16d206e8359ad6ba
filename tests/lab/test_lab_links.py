"""Real slow links: gloo between lab nodes, across a pair the kernel limits and across one it does not."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipemorph.lab import Lab, RateTrace

from lab_helpers import host_network

TRANSFER = str(Path(__file__).with_name("gloo_transfer.py"))
MIB = 1 << 20


def transfer_seconds(lab: Lab, size: int, port: int) -> dict[int, float]:
    """Rank k runs in node k; rank 0 sends ``size`` bytes to each other node in turn."""
    procs = [lab.popen(k, [sys.executable, TRANSFER, str(k), str(lab.nodes), lab.addr(0), str(port), str(size)],
                       env={**os.environ, **lab.node_env(k)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) for k in range(lab.nodes)]
    outs = [p.communicate(timeout=120) for p in procs]
    for k, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {k}: {err[-2000:]}"
    return {int(peer): t for peer, t in json.loads(outs[0][0].strip().splitlines()[-1]).items()}


@pytest.mark.timeout(150)
def test_gloo_send_over_a_40mbit_pair_takes_at_least_its_wire_time_and_an_unshaped_pair_does_not(lab_capable):
    size, rate = 4 * MIB, 40_000_000
    wire_s = 8 * size / rate  # 0.839 s: no 4 MiB message crosses a 40 Mbit/s link faster
    before = host_network()
    with Lab(nodes=3) as lab:
        lab.shape(0, 1, "40mbit")
        assert lab.rate(0, 1) == rate and lab.rate(1, 0) is None and lab.rate(0, 2) is None
        assert host_network() == before  # nothing of the lab lives in the host's namespace
        took = transfer_seconds(lab, size, 29511)
    assert took[1] >= wire_s, took
    assert took[2] < wire_s, took  # same size, same machine, no limit on 0 -> 2


@pytest.mark.timeout(150)
def test_a_rate_change_during_a_transfer_reaches_the_running_job(lab_capable):
    # 0 -> 1 starts at 4 Mbit/s (8 MiB would take 16.8 s) and is raised to 1 Gbit/s after 1 s: the
    # transfer can only end before the slow rate's wire time if the kernel applied the change.
    size, slow = 8 * MIB, 4_000_000
    with Lab(nodes=2) as lab:
        lab.shape(0, 1, slow)
        player = lab.play(0, 1, RateTrace(points=[{"t": 0, "rate": slow}, {"t": 4.0, "rate": "1gbit"}]))
        took = transfer_seconds(lab, size, 29512)
        player.join(5)
        assert [r for _, r in player.applied] == [slow, 1_000_000_000]
        assert lab.rate(0, 1) == 1_000_000_000
    assert took[1] < 8 * size / slow, took
