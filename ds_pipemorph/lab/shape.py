"""Slow links: a rate limit on one directed pair of nodes, changed while a job runs, and links
taken down and up.

The limit sits on the sender's egress: an ``htb`` class under the root qdisc of the sender's
interface and a ``u32`` filter matching the receiver's address. Shaping where packets leave the
sender (rather than on the switch port towards the receiver) gives TCP its ordinary back-pressure:
the class queue fills, the socket stops being drained, ``send`` blocks; no packet is dropped and
retransmitted at the switch, so the rate a transfer sees is the configured one.
"""
from __future__ import annotations

import re

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.lab import names
from ds_pipemorph.lab.net import ip, tc

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_SCALE = {None: 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: "str | int | float") -> int:
    """A rate in bit/s from ``100mbit``, ``1.5gbit``, ``800kbit`` or a number of bit/s."""
    m = _RATE.match(str(text))
    if not m:
        raise BadInput(f"rate '{text}': write a number with an optional unit bit, kbit, mbit or gbit (e.g. 100mbit)")
    bits = int(float(m.group(1)) * _SCALE[m.group(2).lower() if m.group(2) else None])
    if bits < 8000:
        raise BadInput(f"rate '{text}': at least 8kbit, or a single packet takes over a second")
    return bits


def format_rate(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def _classid(dst: int) -> str:
    return f"1:{dst + 16:x}"  # tc reads class minors in hex


def _prio(dst: int) -> str:
    return str(dst + 1)  # one filter priority per receiver, so it can be deleted alone


def _args(rate: int) -> list[str]:
    # quantum: the bytes a class sends per round; a small fixed one keeps htb from warning at high rates.
    return ["rate", f"{rate}bit", "ceil", f"{rate}bit", "quantum", "1514"]


def current_rate(sender_ns: str, dst: int, net: int = 0) -> int | None:
    """The configured rate of the pair (sender -> node ``dst``) in bit/s, or None when unshaped."""
    res = tc(sender_ns, "class", "show", "dev", names.node_ifname(net), "classid", _classid(dst), check=False)
    m = re.search(r"\brate (\S+)", res.stdout)
    return parse_rate(m.group(1).replace("Kbit", "kbit").replace("Mbit", "mbit").replace("Gbit", "gbit")) if m else None


def shape(sender_ns: str, dst: int, rate: int, net: int = 0) -> None:
    """Limit traffic from the node of ``sender_ns`` to node ``dst`` on network ``net`` to ``rate`` bit/s;
    a pair already shaped changes its rate in place (``tc class change``: a running job sees it)."""
    dev = names.node_ifname(net)
    if current_rate(sender_ns, dst, net) is not None:
        tc(sender_ns, "class", "change", "dev", dev, "parent", "1:", "classid", _classid(dst), "htb", *_args(rate))
        return
    tc(sender_ns, "class", "add", "dev", dev, "parent", "1:", "classid", _classid(dst), "htb", *_args(rate))
    tc(sender_ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", _prio(dst),
       "u32", "match", "ip", "dst", f"{names.node_addr(dst, net)}/32", "flowid", _classid(dst))


def unshape(sender_ns: str, dst: int, net: int = 0) -> None:
    """Remove the limit of the pair (nothing happens when it has none)."""
    if current_rate(sender_ns, dst, net) is None:
        return
    dev = names.node_ifname(net)
    tc(sender_ns, "filter", "del", "dev", dev, "parent", "1:", "prio", _prio(dst))
    tc(sender_ns, "class", "del", "dev", dev, "classid", _classid(dst))


def set_link(node_ns: str, up: bool, net: int = 0) -> None:
    """Take a node's interface on network ``net`` down (a real link failure) or bring it back up."""
    ip(node_ns, "link", "set", names.node_ifname(net), "up" if up else "down")
