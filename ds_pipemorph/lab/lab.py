"""``Lab``: N nodes on one machine, each a network namespace, with real rate-limited links.

    with Lab(nodes=3) as lab:
        lab.shape(0, 1, "100mbit")                    # node 0 -> node 1 at 100 Mbit/s
        p = lab.popen(1, ["python", "job.py"], env={**os.environ, **lab.node_env(1)})
        lab.play(0, 1, load_rate_trace("trace.yaml"))  # change the rate while the job runs
        p.wait()

Leaving the ``with`` block (normally, by an exception or Ctrl-C) kills the processes started in
the nodes and removes every namespace; a watchdog process removes them when the lab process is
killed outright. ``Lab(..., keep=True).up()`` makes a lab that outlives the process (the ``pipemorph
lab up`` command): ``Lab.attach(id)`` reaches it again and ``down()`` removes it.
"""
from __future__ import annotations

import functools
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.lab import names, shape as _shape, topology, watchdog
from ds_pipemorph.lab.trace import RateTrace, TracePlayer
from ds_pipemorph.procs import kill_group


@dataclass
class Lab:
    nodes: int = 2
    networks: int = 1
    lab_id: str = field(default_factory=names.new_lab_id)
    keep: bool = False
    _procs: list = field(default_factory=list, repr=False)
    _players: list = field(default_factory=list, repr=False)
    _watchdog: Optional[subprocess.Popen] = field(default=None, repr=False)

    def __post_init__(self):
        names.check_lab_id(self.lab_id)
        if not 1 <= self.nodes <= names.MAX_NODES:
            raise BadInput(f"nodes: {self.nodes} is out of range; a lab has 1 to {names.MAX_NODES} nodes")
        if self.networks not in (1, 2):
            raise BadInput(f"networks: {self.networks}; a lab has 1 network or 2 (a second for delegation.interfaces)")

    # --- life cycle -------------------------------------------------------------------------
    @classmethod
    def attach(cls, lab_id: str) -> "Lab":
        """The lab ``lab_id`` made earlier (by ``pipemorph lab up`` or ``keep=True``)."""
        names.check_lab_id(lab_id)
        nodes = topology.node_count(lab_id)
        if nodes == 0:
            raise BadInput(f"no lab '{lab_id}' here: `pipemorph lab ls` lists the labs")
        return cls(nodes=nodes, networks=max(1, topology.network_count(lab_id)), lab_id=lab_id, keep=True)

    @property
    def prefix(self) -> str:
        return names.lab_prefix(self.lab_id)

    def up(self) -> "Lab":
        if topology.lab_namespaces(self.prefix):
            raise BadInput(f"a lab named '{self.lab_id}' exists already: pick another name or `pipemorph lab down {self.lab_id}`")
        if not self.keep:
            self._watchdog = watchdog.start(self.prefix)
        try:
            topology.build(self.lab_id, self.nodes, self.networks)
        except BaseException:
            self._release_watchdog()
            raise
        return self

    def down(self, grace_s: float = 0.0) -> list[str]:
        """Stop rate traces, kill the processes started in the nodes, remove every namespace;
        returns the namespaces removed. With ``grace_s``, the processes started in the nodes are
        first sent SIGTERM (a launcher passes it on to its ranks, which stop in order) and given that
        long to end. The namespaces are removed whatever fails before; the watchdog is let go only
        once none is left (else it retries when this process ends). The first error of a rate trace
        or of stopping a process is raised afterwards."""
        errors: list[Exception] = []
        try:
            if grace_s > 0:
                self._terminate(grace_s)
            for step in [p.stop for p in self._players] + \
                        [functools.partial(kill_group, c) for c in self._procs if c.poll() is None]:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - raised below, after the teardown
                    errors.append(e)
        finally:
            gone = topology.teardown(self.prefix)
            if not topology.lab_namespaces(self.prefix):
                self._release_watchdog()
        if errors:
            raise errors[0]
        return gone

    def _terminate(self, grace_s: float) -> None:
        """SIGTERM to every live process started in the nodes, then wait until they ended or
        ``grace_s`` passed."""
        live = [c for c in self._procs if c.poll() is None]
        for c in live:
            try:
                c.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(c.poll() is None for c in live):
            time.sleep(0.1)

    def _release_watchdog(self) -> None:
        if self._watchdog is None:
            return
        try:
            self._watchdog.stdin.write(watchdog.DONE)
            self._watchdog.stdin.close()
        except OSError:
            pass
        self._watchdog.wait(timeout=30)
        self._watchdog = None

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # --- where things are --------------------------------------------------------------------
    def ns(self, node: int) -> str:
        self._check_node(node)
        return names.node_ns(self.lab_id, node)

    def addr(self, node: int, net: int = 0) -> str:
        self._check_node(node), self._check_net(net)
        return names.node_addr(node, net)

    def ifname(self, net: int = 0) -> str:
        self._check_net(net)
        return names.node_ifname(net)

    def node_env(self, node: int) -> dict[str, str]:
        """What a distributed job in ``node`` needs: gloo on the node's first interface."""
        self._check_node(node)
        return {"GLOO_SOCKET_IFNAME": names.node_ifname(0)}

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise BadInput(f"node {node}: lab '{self.lab_id}' has nodes 0..{self.nodes - 1}")

    def _check_net(self, net: int) -> None:
        if not 0 <= net < self.networks:
            raise BadInput(f"network {net}: lab '{self.lab_id}' has {'only network 0' if self.networks == 1 else 'networks 0 and 1'}")

    # --- links ----------------------------------------------------------------------------
    def shape(self, src: int, dst: int, rate: "str | int", net: int = 0, both: bool = False) -> None:
        """Limit ``src -> dst`` (and ``dst -> src`` when ``both``) to ``rate``; a shaped pair changes rate."""
        bits = _shape.parse_rate(rate)
        for a, b in self._pairs(src, dst, net, both):
            _shape.shape(self.ns(a), b, bits, net)

    def unshape(self, src: int, dst: int, net: int = 0, both: bool = False) -> None:
        for a, b in self._pairs(src, dst, net, both):
            _shape.unshape(self.ns(a), b, net)

    def rate(self, src: int, dst: int, net: int = 0) -> Optional[int]:
        """The configured rate of ``src -> dst`` in bit/s, None when unshaped."""
        (a, b), = self._pairs(src, dst, net, False)
        return _shape.current_rate(self.ns(a), b, net)

    def play(self, src: int, dst: int, trace: RateTrace, net: int = 0, both: bool = False) -> TracePlayer:
        """Play a rate trace on the pair in the background (point t=0 applies at once)."""
        pairs = self._pairs(src, dst, net, both)

        def apply(bits: int) -> None:
            for a, b in pairs:
                _shape.shape(self.ns(a), b, bits, net)

        player = TracePlayer(trace, apply).start()
        self._players.append(player)
        return player

    def change_at(self, src: int, dst: int, rate: "str | int", after_s: float, net: int = 0,
                  both: bool = False) -> TracePlayer:
        """Change the pair's rate ``after_s`` seconds from now (in the background)."""
        return self.play(src, dst, RateTrace(points=[{"t": after_s, "rate": rate}]), net, both)

    def link_down(self, node: int, net: int = 0) -> None:
        self._check_net(net)
        _shape.set_link(self.ns(node), False, net)

    def link_up(self, node: int, net: int = 0) -> None:
        self._check_net(net)
        _shape.set_link(self.ns(node), True, net)

    def _pairs(self, src: int, dst: int, net: int, both: bool) -> list[tuple[int, int]]:
        self._check_node(src), self._check_node(dst), self._check_net(net)
        if src == dst:
            raise BadInput(f"pair {src}-{dst}: a link joins two different nodes")
        return [(src, dst), (dst, src)] if both else [(src, dst)]

    # --- running commands in nodes -------------------------------------------------------------
    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside ``node`` (``ip netns exec``): any launcher works unchanged."""
        return ["ip", "netns", "exec", self.ns(node), *cmd]

    def popen(self, node: int, cmd: Sequence[str], **popen_kw) -> subprocess.Popen:
        """Start ``cmd`` in ``node`` in a session of its own; the lab kills it (and its children) at exit."""
        proc = subprocess.Popen(self.command(node, cmd), start_new_session=True, **popen_kw)
        self._procs.append(proc)
        return proc
