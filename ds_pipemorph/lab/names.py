"""Names and addresses of a lab: every namespace a lab makes carries its prefix, so a leftover is
always found by name (``pipemorph lab down`` removes every namespace starting with ``PREFIX``)."""
from __future__ import annotations

import re
import secrets

from ds_pipemorph.fileio import BadInput

PREFIX = "pmlab-"
# Each network is a /24 of the benchmarking range 198.18.0.0/15; node k has host address k + 1.
NETWORKS = ("198.18.0", "198.19.0")
MAX_NODES = 200
_LAB_ID = re.compile(r"^[a-z0-9]{1,8}$")


def new_lab_id() -> str:
    return secrets.token_hex(3)


def check_lab_id(lab_id: str) -> str:
    if not _LAB_ID.match(lab_id):
        raise BadInput(f"lab name '{lab_id}': use 1 to 8 lowercase letters or digits")
    return lab_id


def lab_prefix(lab_id: str) -> str:
    """The prefix of every namespace of one lab (the trailing dash keeps lab 'a1' apart from 'a10')."""
    return f"{PREFIX}{lab_id}-"


def node_ns(lab_id: str, node: int) -> str:
    return f"{lab_prefix(lab_id)}n{node}"


def switch_ns(lab_id: str) -> str:
    return f"{lab_prefix(lab_id)}sw"


def node_ifname(net: int) -> str:
    """A node's interface on network ``net`` (0: the first network, 1: the second)."""
    return f"eth{net}"


def bridge_name(net: int) -> str:
    return f"br{net}"


def port_name(node: int, net: int) -> str:
    """The switch's end of node ``node``'s cable on network ``net``."""
    return f"p{node}n{net}"


def node_addr(node: int, net: int = 0) -> str:
    return f"{NETWORKS[net]}.{node + 1}"


def parse_ns(name: str) -> tuple[str, str] | None:
    """(lab id, 'sw' or 'n<k>') of a lab namespace name, else None."""
    if not name.startswith(PREFIX):
        return None
    lab_id, _, part = name[len(PREFIX):].rpartition("-")
    return (lab_id, part) if lab_id and part else None
