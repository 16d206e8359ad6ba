"""Building a lab's namespaces, cables and switches, and removing every namespace of a lab.

A node is a network namespace with ``lo`` up and one interface per network (``eth0`` on
198.18.0.0/24, ``eth1`` on 198.19.0.0/24), a veth pair whose other end is a port of that network's
bridge. The bridges live in a namespace of their own (the switch), so nothing is created in the
host's network namespace. Each node interface gets an ``htb`` root qdisc whose unclassified traffic
goes out unshaped; a shaped pair adds a class and a filter under it (``shape.py``).
"""
from __future__ import annotations

import os
import signal
import time

from ds_pipemorph.lab import names
from ds_pipemorph.lab.net import ip, list_ns, ns_pids, run, tc


def build(lab_id: str, nodes: int, networks: int) -> None:
    """Create the lab; on any failure remove what was made and re-raise."""
    sw = names.switch_ns(lab_id)
    try:
        ip(None, "netns", "add", sw)
        for net in range(networks):
            ip(sw, "link", "add", names.bridge_name(net), "type", "bridge")
            ip(sw, "link", "set", names.bridge_name(net), "up")
        for k in range(nodes):
            ns = names.node_ns(lab_id, k)
            ip(None, "netns", "add", ns)
            ip(ns, "link", "set", "lo", "up")
            for net in range(networks):
                _cable(ns, sw, k, net)
    except BaseException:
        teardown(names.lab_prefix(lab_id))
        raise


def _cable(ns: str, sw: str, node: int, net: int) -> None:
    dev, port = names.node_ifname(net), names.port_name(node, net)
    ip(ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", sw)
    ip(sw, "link", "set", port, "master", names.bridge_name(net))
    ip(sw, "link", "set", port, "up")
    ip(ns, "addr", "add", f"{names.node_addr(node, net)}/24", "dev", dev)
    ip(ns, "link", "set", dev, "up")
    # The root qdisc every shaped pair of this sender hangs off; default 0 = unclassified is unshaped.
    tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb")


def lab_namespaces(prefix: str) -> list[str]:
    return [n for n in list_ns() if n.startswith(prefix)]


def teardown(prefix: str) -> list[str]:
    """Kill every process inside the namespaces whose name starts with ``prefix`` and delete those
    namespaces (their veth ends, bridges and qdiscs go with them). Returns the names removed.

    Shared-memory reapers (``runtime.reaper``) started by the nodes' training processes live in the
    nodes' namespaces too: they are killed last, once the processes they watch are gone and they had
    ``REAPER_GRACE_S`` to remove those processes' staging rings."""
    gone = []
    spaces = lab_namespaces(prefix)
    for ns in spaces:
        _kill(p for p in ns_pids(ns) if not _is_reaper(p))
    for ns in spaces:
        _wait_empty(ns, keep=_is_reaper, seconds=5.0)
    for ns in spaces:
        _wait_empty(ns, seconds=REAPER_GRACE_S)  # each reaper exits once its owner is gone
    for ns in spaces:
        _kill(ns_pids(ns))
        _wait_empty(ns, seconds=5.0)  # a killed process leaves the namespace at once; a D-state one may lag
        if run(["ip", "netns", "del", ns], check=False).returncode == 0:
            gone.append(ns)
    return gone


REAPER_GRACE_S = 3.0
_REAPER = os.path.join("ds_pipemorph", "runtime", "reaper.py")


def _is_reaper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return any(a.decode(errors="replace").endswith(_REAPER) for a in f.read().split(b"\0"))
    except OSError:
        return False


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_empty(ns: str, keep=None, seconds: float = 5.0) -> None:
    """Until no process but those ``keep`` accepts is left in ``ns``, at most ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not [p for p in ns_pids(ns) if keep is None or not keep(p)]:
            return
        time.sleep(0.1)


def lab_ids() -> dict[str, list[str]]:
    """Every lab present: lab id -> its namespaces."""
    out: dict[str, list[str]] = {}
    for ns in list_ns():
        parsed = names.parse_ns(ns)
        if parsed:
            out.setdefault(parsed[0], []).append(ns)
    return out


def node_count(lab_id: str) -> int:
    return sum(1 for ns in lab_namespaces(names.lab_prefix(lab_id)) if names.parse_ns(ns)[1].startswith("n"))


def network_count(lab_id: str) -> int:
    res = ip(names.switch_ns(lab_id), "-o", "link", "show", "type", "bridge", check=False)
    return sum(1 for line in res.stdout.splitlines() if line.strip())
