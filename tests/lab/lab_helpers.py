"""What the lab tests check the machine with."""
import os
import subprocess

from ds_pipemorph.lab.names import PREFIX


def namespaces(prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def host_network() -> tuple[str, str]:
    """The host namespace's links and qdiscs, without counters: what a lab must never change."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    names = sorted(line.split(":")[1].strip() for line in links.splitlines() if ":" in line)
    return "\n".join(names), qdiscs


def alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped, has left every namespace already)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
