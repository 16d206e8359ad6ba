"""Running ``ip`` and ``tc``: a failed command becomes one sentence; missing privilege is named."""
from __future__ import annotations

import subprocess

from ds_pipemorph.fileio import BadInput


class NoPrivilege(BadInput):
    """The lab cannot create namespaces or links here (not root, or capabilities dropped)."""


NO_PRIVILEGE = ("building a lab needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN "
                "(creating a network namespace was refused): run it as root")
_REFUSED = ("Operation not permitted", "Permission denied")


def run(cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run ``cmd``; when ``check``, a non-zero exit raises BadInput quoting the command and its error."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise BadInput(f"'{cmd[0]}' is not installed: the lab needs iproute2 (ip, tc)") from None
    if check and res.returncode != 0:
        err = (res.stderr.strip().splitlines() or ["exit code %d" % res.returncode])[-1]
        if any(word in err for word in _REFUSED):
            raise NoPrivilege(NO_PRIVILEGE)
        raise BadInput(f"'{' '.join(cmd)}' failed: {err}")
    return res


def ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip`` inside namespace ``ns`` (``ip -n NS``); never in the host's namespace unless ns is None
    for the commands that manage namespaces themselves (``ip netns ...``)."""
    return run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["tc", "-n", ns, *args], check=check)


def list_ns() -> list[str]:
    """Names of every network namespace under /run/netns."""
    res = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    res = run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in res.stdout.split() if x.isdigit()]
