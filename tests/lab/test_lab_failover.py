"""A real interface failure under a 4-node job in the lab (``benchmarks/lab/lab_failover.py`` runs the jobs).

Two networks, every link delegated with ``delegation.interfaces: [eth0, eth1]`` (the ranks' own
process group on eth1): node 2's eth0 goes down after two iterations; the job finishes, its parameters
equal those of a fault-free run of the same job within 1e-6, and the log names the link and the
interface its delegates moved to. One network: the same fault ends the job with an error naming a
link, every node's process exits (none is still running when the launcher's wait runs out).
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "lab"))

from lab_failover import FAULT_NODE, run_one, run_two  # noqa: E402

TIMEOUT_S = 30.0  # the engine's timeout_s
ITERATIONS, FAULT_AFTER = 6, 2


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_primary_interface_down_with_two_networks_moves_the_delegates_to_eth1_and_trains_as_fault_free(
        lab_capable, tmp_path):
    r = run_two(tmp_path, ITERATIONS, FAULT_AFTER, TIMEOUT_S)
    assert r["fault_free_codes"] == [0] * 4, r["ref"].log_text()[-4000:]
    assert r["faulted_codes"] == [0] * 4, r["faulted"].log_text()[-6000:]
    assert len(r["iteration_ms"]) == ITERATIONS
    assert r["max_param_diff"] <= 1e-6
    # The links of node 2 (stage 2 ends links 1 and 2) moved to the second interface, and the log says so.
    moved = [e for e in r["events"] if "on interface eth1" in e]
    assert any(f"link {k}:" in e for e in moved for k in (FAULT_NODE - 1, FAULT_NODE)), r["events"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_interface_down_with_one_network_ends_the_job_with_an_error_naming_the_link(lab_capable, tmp_path):
    r = run_one(tmp_path, ITERATIONS, FAULT_AFTER, TIMEOUT_S)
    log = r["job"].log_text()
    assert "timeout" not in r["codes"], f"a node was still running: {r['codes']}\n{log[-6000:]}"
    assert all(c != 0 for c in r["codes"]), r["codes"]
    assert any(f"link {k} " in e for e in r["errors"] for k in (FAULT_NODE - 1, FAULT_NODE)), log[-6000:]
