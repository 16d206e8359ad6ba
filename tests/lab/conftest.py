"""Lab tests need root and network namespaces; they skip, with the reason, where those are refused."""
from __future__ import annotations

import os
import subprocess

import pytest

from ds_pipemorph.lab.names import PREFIX


def _lab_refusal() -> str | None:
    probe = f"{PREFIX}probe{os.getpid()}-sw"
    try:
        res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "iproute2 (ip) is not installed"
    if res.returncode != 0:
        return f"cannot create a network namespace here ({res.stderr.strip() or 'ip netns add failed'})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


_REASON = _lab_refusal()


@pytest.fixture
def lab_capable():
    if _REASON:
        pytest.skip(f"the lab needs root and network namespaces: {_REASON}")
