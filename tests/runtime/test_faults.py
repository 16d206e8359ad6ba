"""Training survives faults (PipeMorph §5.3): a link that fails in the middle of an iteration and a
delegate killed mid-run. Real PipeMorphEngine on 3 stages (4 micro-batches, 3 optimizer steps),
faults configured in ``pipemorph.inject.faults``; each faulted run must finish, run every F, B and W
of every micro-batch exactly once per step, and end with the losses and parameters of the same
config without faults (within 1e-6).

- ``link_fails``: the direct path of link 0 fails from its 6th message per direction (step 2,
  micro-batch 1) and link 1, which has 10 ms injected, from its 7th (step 2, micro-batch 2): there the
  send fails in the delay's delivery thread. Both ends move each direction to the delegates.
- ``kill_sender`` / ``kill_receiver``: every link delegated (2 queues, 10 ms on each link); the sender
  delegate carrying link 1's 6th activation is SIGKILLed right after that send, or the receiver delegate
  of link 0's 6th activation right after the 5th arrived. The training process restarts it and
  re-sends what was not acknowledged; the receiver drops duplicates.
"""
from __future__ import annotations

import pytest

from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config
from ds_pipemorph.inject.faults import Faults, faults_from_config

from .launch import SHARED_CEILING, max_param_diff, shared_jobs

TOL = 1e-6
STAGES, N, STEPS = 3, 4, 3


def _section(mode: str, delays: dict, faults: dict | None = None, interfaces: list | None = None) -> dict:
    inject = {"links": {k: {"delay_ms": v} for k, v in delays.items()}}
    if faults is not None:
        inject["faults"] = faults
    delegation = {"mode": mode, "queues": 1 if mode == "auto" else 2}
    if interfaces:
        delegation["interfaces"] = interfaces
    return {"schedule": "zb", "adapt": {"enabled": False}, "nvtx": False, "timeout_s": 120,
            "delegation": delegation, "inject": inject}


def _second_interface() -> str:
    """An interface with an address other than the loopback, if this host has one (else the loopback)."""
    import socket

    import psutil

    up = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name != "lo" and up.get(name) and up[name].isup and any(a.family == socket.AF_INET for a in addrs):
            return name
    return "lo"


# The killed sender's pair meets again as generation 1 on the second interface of this list.
INTERFACES = ["lo", _second_interface()]


DIRECT, DELEGATED = ("auto", {"1": 10.0}), ("always", {"0": 10.0, "1": 10.0})
JOBS = {  # name: (config, faults, fault-free reference[, delegation.interfaces])
    "direct_ref": (DIRECT, None, None),
    "link_fails": (DIRECT, {"link_fails_after": {"0": 5, "1": 6}}, "direct_ref"),
    "delegated_ref": (DELEGATED, None, None),
    "kill_sender": (DELEGATED, {"kill_delegate": {"link": 1, "after": 6}}, "delegated_ref", INTERFACES),
    "kill_receiver": (DELEGATED, {"kill_delegate": {"link": 0, "after": 5, "side": "recv"}}, "delegated_ref"),
}
# Per faulted job and stage: log lines that must appear (each names the op where the fault hit).
EXPECTED_EVENTS = {
    "link_fails": {
        0: ["link 0 direct path failed at SEND_F1", "link 0 direct path failed at RECV_B1"],
        1: ["link 0 direct path failed at RECV_F1", "link 0 direct path failed at SEND_B1",
            "link 1 direct path failed at SEND_F2", "link 1 direct path failed at RECV_B2"],
        2: ["link 1 direct path failed at RECV_F2", "link 1 direct path failed at SEND_B2"],
    },
    "kill_sender": {1: ["killed the sender delegate of F queue 1", "link 1: sender delegate of F queue 1"]},
    "kill_receiver": {1: ["killed the receiver delegate of F queue 1", "link 0: receiver delegate of F queue 1"]},
}


def _result(run, name: str, rank: int) -> dict:
    """The rank's result file, or a failure showing the first traceback of the launch's output."""
    if not run.path_of(name, rank).exists():
        start = run.output.find("Traceback")
        shown = run.output[start:start + 6000] if start >= 0 else run.output[-4000:]
        pytest.fail(f"{name} rank {rank} wrote no result; launch output from its first traceback:\n{shown}")
    return run.result(name, rank)


def _ran_every_op_once(ops: list[str]) -> bool:
    ran = [op for op in ops if op[0] in "FBW" and op[1:].isdigit()]
    return sorted(ran) == sorted(f"{k}{m}" for k in "FBW" for m in range(N))


@shared_jobs("faults", timeout=380, ranks=STAGES)  # run in the session's shared 3-rank launch
def _jobs(files) -> list[dict]:
    return [{"name": name, "stages": STAGES, "micro_batches": N, "steps": STEPS,
             "pipemorph": _section(*cfg, faults, *rest[1:])} for name, (cfg, faults, *rest) in JOBS.items()]


@pytest.mark.timeout(SHARED_CEILING + 60)  # the first test to ask for the shared launch waits for all of it
def test_link_failure_mid_iteration_and_killed_delegates_lose_and_repeat_nothing(shared3):
    run = shared3["faults"]
    res = {name: {_result(run, name, r)["stage"]: _result(run, name, r) for r in range(STAGES)} for name in JOBS}
    for name, (_, _, ref_name, *_) in JOBS.items():
        for stage, got in res[name].items():
            assert len(got["losses"]) == STEPS, f"{name} stage {stage}: {got['losses']}"
            assert all(_ran_every_op_once(step) for step in got["ops"]), f"{name} stage {stage}: {got['ops']}"
            if ref_name is None:
                assert got["events"] == [], f"{name} stage {stage}: {got['events']}"
                continue
            ref = res[ref_name][stage]
            assert got["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} stage {stage}: losses differ"
            assert max_param_diff(got, ref) <= TOL, f"{name} stage {stage}: parameters differ"
            for needle in EXPECTED_EVENTS[name].get(stage, []):
                assert any(needle in e for e in got["events"]), f"{name} stage {stage}: {needle!r} not in {got['events']}"
    # Link 1's sends failed in the delay's delivery thread; link 0 (no delay) failed in the send itself.
    failed_sends = {s: [e for e in res["link_fails"][s]["events"] if "direct path failed at SEND" in e] for s in range(3)}
    assert all("in the delivery thread" in e for s in (1, 2) for e in failed_sends[s] if "link 1 " in e)
    assert not any("in the delivery thread" in e for e in failed_sends[0] + failed_sends[1] if "link 0 " in e)
    # The killed sender delegate was restarted (re-sending what its peer had not acknowledged), and
    # its pair met again on the next configured interface (§5.3: reconnect on another interface).
    assert any(f"restarted it as generation 1 on interface {INTERFACES[1]}" in e for e in res["kill_sender"][1]["events"])


def test_fault_settings_are_read_from_the_inject_section_and_bad_links_are_refused():
    cfg = parse_config(_section("always", {}, {"link_fails_after": {"1": 3}, "kill_delegate": {"link": 0, "after": 2}}))
    assert faults_from_config(cfg.inject.faults, 3) == Faults(link_fails_after={1: 3}, kill_delegate=(0, 2),
                                                              kill_side="send")
    assert faults_from_config(parse_config({}).inject.faults, 3) is None
    with pytest.raises(PipeMorphConfigError, match=r"^ds_config pipemorph.inject.faults.link_fails_after names "
                                                   r"link 2, but a 3-stage pipeline has links 0..1$"):
        faults_from_config(parse_config(_section("auto", {}, {"link_fails_after": {"2": 3}})).inject.faults, 3)
    with pytest.raises(PipeMorphConfigError, match=r"^ds_config pipemorph: inject.faults.kill_delegate needs "
                                                   r"delegation.mode 'always'"):
        parse_config(_section("auto", {}, {"kill_delegate": {"link": 0, "after": 2}}))
    with pytest.raises(PipeMorphConfigError, match=r"link_fails_after: link 1 cannot fail after a negative"):
        parse_config(_section("auto", {}, {"link_fails_after": {"1": -1}}))
