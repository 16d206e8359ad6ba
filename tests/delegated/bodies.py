"""Rank bodies of the delegated-transport tests (run in spawned processes through workers.run)."""
import time

import torch
import torch.distributed as dist
from workers import payload, same

from ds_pipemorph.runtime.transport.delegated.transport import DelegatedTransport
from ds_pipemorph.runtime.transport.protocol import TransportTimeout


def roundtrip(rank, world, queues, order, slot_bytes):
    """Stage 0 sends F0..F(n-1) (and receives B), stage 1 receives in ``order`` and sends B back."""
    n = len(order)
    tr = DelegatedTransport(rank, rank, list(range(world)), timeout_s=60.0, queues=queues, slot_bytes=slot_bytes)
    ok = []
    try:
        for it in range(2):  # two iterations: mb numbers repeat, delegates are reused
            if rank == 0:
                for m in range(n):
                    tr.send("F", m, payload("F", m + it))
                for m in range(n):
                    ok.append(same(tr.recv("B", m), payload("B", m + it)))
            else:
                for m in order:
                    ok.append(same(tr.recv("F", m), payload("F", m + it)))
                for m in range(n):
                    tr.send("B", m, payload("B", m + it))
            tr.wait_sends()
        pids = [q.proc.pid for d in tr._dirs.values() for q in d.queues]
    finally:
        tr.close()
    return dict(ok=ok, delegates=len(pids), events=tr.events)


def prefetch(rank, world, n, slot_bytes):
    """Stage 1 posts F0..F(n-1) ahead, then idles: the prefetch thread must assemble every posted
    message (and no other) without a recv; recv then only hands them over, intact. Stage 0 sends
    n + 1 messages; the last one was never posted and must stay in its ring until asked for (at an
    iteration boundary nothing of the next iteration may be read early)."""
    tr = DelegatedTransport(rank, rank, list(range(world)), timeout_s=60.0, queues=2, slot_bytes=slot_bytes)
    out = {}
    try:
        if rank == 0:
            for m in range(n + 1):
                tr.send("F", m, payload("F", m))
            tr.wait_sends()
        else:
            for m in range(n):
                tr.post_recv("F", m)
            d = tr._direction("F", False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with d.cv:
                    if len(d.stash) == n and not d.busy:
                        break
                time.sleep(0.01)
            time.sleep(0.3)  # time for a wrong prefetch of the unposted message to show
            with d.cv:
                out["stashed_before_recv"] = sorted(m for _, m in d.stash)
            out["ok"] = [same(tr.recv("F", m), payload("F", m)) for m in range(n)]
            out["unposted_ok"] = same(tr.recv("F", n), payload("F", n))
        dist.barrier()
    finally:
        tr.close()
    return out


def _cfg(mode, delay_ms=0.0, queues=2, timeout_s=60.0, trace=None):
    from ds_pipemorph.runtime.config import PipeMorphConfig

    links = {"0": {"delay_ms": delay_ms}} if delay_ms else {}
    return PipeMorphConfig.model_validate({"delegation": {"mode": mode, "queues": queues},
                                           "inject": {"links": links, "trace": trace}, "timeout_s": timeout_s})


def trace_latency(rank, world, modes, trace, total_s):
    """Per mode: stage 0 sends stamped activations one at a time (each waits until received) for
    ``total_s`` seconds of the trace's clock; returns, on stage 1, (sent at t, delivery latency) per message."""
    from ds_pipemorph.runtime.transport.router import build_transport

    out = {}
    for mode in modes:
        tr = build_transport(_cfg(mode, queues=1, trace=trace), rank, rank, list(range(world)), None, {})
        try:
            if mode == "always":
                tr.delegated.wait_ready(60.0)
            dist.barrier()
            got, m, last = [], 0, False
            while not last:
                if rank == 0:
                    origin = tr.delegated.delays.origin
                    t = 0.0 if origin is None else time.monotonic() - origin
                    last = t > total_s
                    tr.send("F", m, torch.tensor([time.monotonic(), t, float(last)], dtype=torch.float64))
                    tr.wait_sends()
                else:
                    stamp, t, flag = tr.recv("F", m).tolist()
                    got.append((t, time.monotonic() - stamp))
                    last = bool(flag)
                m += 1
            out[mode] = got
            dist.barrier()
        finally:
            tr.close()
    return out


def hol(rank, world, mode, delay_ms, sends, op_ms, rounds=1):
    """Stage 0 issues ``sends`` activation sends spaced by ``op_ms`` of 'compute', ``rounds`` times;
    returns the time each send took, per round (stage 1: arrival times and contents)."""
    from ds_pipemorph.runtime.transport.router import build_transport

    tr = build_transport(_cfg(mode, delay_ms), rank, rank, list(range(world)), None, {})
    res = dict(took=[], issued=[], arrivals=[], ok=[])
    try:
        if mode == "always":
            tr.delegated.wait_ready(60.0)  # start-up (spawning delegates) is not what is measured
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:
                took = []
                t_start = time.perf_counter()
                for m in range(sends):
                    time.sleep(op_ms / 1000.0)  # the op that produced the activation
                    t = time.perf_counter()
                    tr.send("F", m, torch.full((256,), float(m)))
                    took.append(time.perf_counter() - t)
                res["issued"].append(time.perf_counter() - t_start)
                res["took"].append(took)
            else:
                arrivals = []
                t0 = time.perf_counter()
                for m in range(sends):
                    x = tr.recv("F", m)
                    arrivals.append(time.perf_counter() - t0)
                    res["ok"].append(bool((x == m).all()))
                res["arrivals"].append(arrivals)
            tr.wait_sends()
        return res
    finally:
        tr.close()


def switching(rank, world, iterations_modes, n):
    """Each iteration: stage 0 sends F0..F(n-1), stage 1 (after a pause) receives them and sends B back;
    between iterations both ends switch link 0 to the next mode. Returns what arrived and by which path."""
    from ds_pipemorph.runtime.transport.router import build_transport

    tr = build_transport(_cfg("auto", delay_ms=5.0, queues=1), rank, rank, list(range(world)), None, {})
    got = []
    try:
        for it, spec in enumerate(iterations_modes):
            mode, _, queues = spec.partition(":")  # "delegated:3": with 3 queues (grown at this boundary)
            tr.set_link_mode(0, mode, int(queues) if queues else None)
            before = dict(tr.delegated.sent)
            if rank == 0:
                for m in range(n):
                    tr.send("F", m, (torch.tensor([it, m]), torch.full((3,), m, dtype=torch.bfloat16)))
                for m in range(n):
                    b = tr.recv("B", m)
                    got.append((it, "B", m, b.tolist()))
            else:
                time.sleep(0.05)  # the messages queue up while this stage 'computes'
                for m in range(n):
                    a, c = tr.recv("F", m)
                    got.append((it, "F", m, a.tolist(), c.float().tolist()))
                    tr.send("B", m, torch.tensor([it, m, 100]))
            tr.wait_sends()
            got.append((it, "delegated_sends", tr.delegated.sent.get(0, 0) - before.get(0, 0)))
            got.append((it, "queues", tr.delegated.queues_of(0),
                        sum(d.active for d in tr.delegated._dirs.values())))
            got.append((it, "pids", {key: [q.proc.pid for q in d.queues] for key, d in tr.delegated._dirs.items()}))
        return got
    finally:
        tr.close()


def faulty(rank, world, mode, faults_kw, delay_ms, iterations, n, queues=2):
    """Two-stage exchange under injected faults; returns what each recv got and the recovery log lines."""
    from ds_pipemorph.inject.delays import delay_schedule
    from ds_pipemorph.inject.faults import Faults
    from ds_pipemorph.inject.plugin import InjectTransport
    from ds_pipemorph.runtime.transport.router import build_transport

    cfg = _cfg(mode, delay_ms=delay_ms, queues=queues, timeout_s=40.0)
    hooks = InjectTransport(delay_schedule(cfg.inject, world), Faults(**faults_kw))
    tr = build_transport(cfg, rank, rank, list(range(world)), None, {}, hooks=[hooks])
    ok = []
    try:
        for it in range(iterations):
            if rank == 0:
                for m in range(n):
                    tr.send("F", m, payload("F", m + 10 * it))
                for m in range(n):
                    ok.append(same(tr.recv("B", m), payload("B", m + 10 * it)))
            else:
                for m in range(n):
                    ok.append(same(tr.recv("F", m), payload("F", m + 10 * it)))
                    tr.send("B", m, payload("B", m + 10 * it))
            tr.wait_sends()
        dist.barrier()  # as the engine's end-of-step collective: no end closes while the other waits for acks
        dl = tr.delegated
        seqs = {f"{d.kind}{'s' if d.sending else 'r'}": d.next_seq for d in dl._dirs.values()}
        leftovers = sum(len(d.stash) + (d.partial is not None) for d in dl._dirs.values())
        return dict(ok=ok, events=list(tr.events) + list(dl.events), seqs=seqs, leftovers=leftovers,
                    modes={k: tr.link_mode(0, k) for k in "FB"})
    finally:
        tr.close()


def killed_before_meeting(rank, world, n, timeout_s):
    """Stage 0 kills its F sender delegate right after starting it, before stage 1 has even started
    its own delegates (so the pair never met); then the two stages exchange n messages each way."""
    import os
    import signal

    tr = DelegatedTransport(rank, rank, list(range(world)), timeout_s=timeout_s, queues=1)
    ok = []
    t0 = time.monotonic()
    try:
        if rank == 0:
            tr.start_link(0)
            os.kill(tr.delegate_pid(0, "F", True, 0), signal.SIGKILL)
            dist.barrier()
            for m in range(n):
                tr.send("F", m, payload("F", m))
            ok = [same(tr.recv("B", m), payload("B", m)) for m in range(n)]
        else:
            dist.barrier()
            for m in range(n):
                ok.append(same(tr.recv("F", m), payload("F", m)))
                tr.send("B", m, payload("B", m))
        tr.wait_sends()
        dist.barrier()  # stage 0's receiver delegates must stay up to acknowledge stage 1's last message
    finally:
        tr.close()
    return dict(ok=ok, events=list(tr.events), took_s=time.monotonic() - t0)


def orphan_delegates(port, out, close):
    """Start the delegates of link 0, report their pids, then close the transport or die without closing."""
    import os

    tr = DelegatedTransport(0, 0, [0, 1], timeout_s=30.0, queues=1, store_addr="127.0.0.1", store_port=port)
    tr.start_link(0)
    pids = [q.proc.pid for d in tr._dirs.values() for q in d.queues]
    if close:
        tr.close()
        out.put((pids, [p for p in pids if _running(p)]))
        return
    out.put((pids, None))
    out.close()
    out.join_thread()  # flush before dying
    os._exit(0)  # the training process dies: its delegates must notice and exit


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def _shmem_kib() -> int:
    """This process's resident shared memory (the staging rings' pages it touched), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def ring_residency(rank, world, fit_ring, n, mib):
    """Stage 0 sends n messages of ``mib`` MiB (F), stage 1 receives them; each reports how much of the
    staging rings became resident in it (its send rings on stage 0, its receive rings on stage 1)."""
    before = _shmem_kib()
    tr = DelegatedTransport(rank, rank, list(range(world)), timeout_s=60.0, queues=2, max_queues=4,
                            num_slots=4, slot_bytes=64 << 20, fit_ring=fit_ring)
    ok = []
    try:
        for m in range(n):
            if rank == 0:
                tr.send("F", m, torch.full((mib << 18,), float(m)))
            else:
                got = tr.recv("F", m)
                ok.append(got.shape == (mib << 18,) and bool((got == float(m)).all()))
        tr.wait_sends()
        resident = _shmem_kib() - before
    finally:
        tr.close()
    return dict(ok=ok, resident_kib=resident)


def copies_beside_a_delay(rank, world, mib, delay_ms):
    """With the link delayed by ``delay_ms`` per message (the delegates apply it) and the default memory
    budget (messages cut to fit one queue's ring), stage 0 sends two messages of ``mib`` MiB, one per
    queue, and reports whether both copies into the rings ended within 0.8 of the delay, while the
    delegates still hold the first message for its delay; stage 1 checks what arrives."""
    from ds_pipemorph.runtime.transport.router import build_transport

    tr = build_transport(_cfg("always", delay_ms), rank, rank, list(range(world)), None, {})
    res = dict(fit_ring=tr.delegated.fit_ring, copied_in_time=None, ok=[])
    try:
        tr.delegated.wait_ready(60.0)
        dist.barrier()
        if rank == 0:
            for m in range(2):
                tr.send("F", m, torch.full((mib << 18,), float(m)))
            try:
                tr.delegated._copier.drain(0.8 * delay_ms / 1000.0)
                res["copied_in_time"] = True
            except TransportTimeout:
                res["copied_in_time"] = False
        else:
            for m in range(2):
                got = tr.recv("F", m)
                res["ok"].append(bool((got == float(m)).all()))
        tr.wait_sends()
    finally:
        tr.close()
    return res
