"""``pipemorph lab up|ls|shape|link|run|launch|down``: the network lab (``ds_pipemorph.lab``) from the
command line. Needs root. ``up`` makes a lab that stays until ``down``; ``launch`` makes one for a
single job and removes it when the job ends, however it ends."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.table import Table

from ds_pipemorph.fileio import BadInput, check_writable_dir

from .common import console, err_console, stopped_by_signal, user_errors

app = typer.Typer(
    help="A network lab on one machine: nodes are network namespaces, slow links are kernel rate limits (root only).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_PASS = {"allow_extra_args": True, "ignore_unknown_options": True}
_PAIR = re.compile(r"^(\d+)([-=])(\d+):(.+)$")


def _nodes_table(lab) -> Table:
    table = Table(title=f"lab {lab.lab_id}")
    for col in ("node", "namespace", *(f"{lab.ifname(n)} address" for n in range(lab.networks))):
        table.add_column(col)
    for k in range(lab.nodes):
        table.add_row(str(k), lab.ns(k), *(lab.addr(k, n) for n in range(lab.networks)))
    return table


@app.command("up")
def up(
    nodes: int = typer.Option(..., "--nodes", min=1, help="How many nodes (network namespaces)."),
    networks: int = typer.Option(1, "--networks", min=1, max=2, help="2 adds a second network (eth1, 198.19.0.x) for delegation.interfaces."),
    name: Optional[str] = typer.Option(None, "--name", help="Lab name (1-8 lowercase letters or digits; default: random)."),
) -> None:
    """Build a lab that stays until `pipemorph lab down NAME`; prints its nodes and addresses."""
    from ds_pipemorph.lab import Lab

    with user_errors():
        lab = Lab(nodes=nodes, networks=networks, keep=True, **({"lab_id": name} if name else {})).up()
    console.print(_nodes_table(lab))
    console.print(f"lab {lab.lab_id} is up: `pipemorph lab run {lab.lab_id} NODE -- CMD` runs a command in a node")


@app.command("ls")
def ls() -> None:
    """List the labs on this machine with their nodes and shaped pairs."""
    from ds_pipemorph.lab import Lab, format_rate
    from ds_pipemorph.lab.topology import lab_ids

    with user_errors():
        ids = lab_ids()
        table = Table()
        for col in ("lab", "nodes", "networks", "shaped pairs"):
            table.add_column(col)
        for lab_id in sorted(ids):
            try:
                lab = Lab.attach(lab_id)
            except BadInput:  # not a lab this version makes (a bad name, no nodes): a leftover
                table.add_row(lab_id, "-", "-", "leftover namespaces: `pipemorph lab down --all` removes them")
                continue
            shaped = [f"{a}->{b} net{n} {format_rate(r)}" for n in range(lab.networks) for a in range(lab.nodes)
                      for b in range(lab.nodes) if a != b and (r := lab.rate(a, b, n)) is not None]
            table.add_row(lab_id, str(lab.nodes), str(lab.networks), ", ".join(shaped) or "-")
    console.print(table if ids else "no labs")


@app.command("shape")
def shape(
    lab_id: str = typer.Argument(..., metavar="LAB"),
    src: int = typer.Argument(..., metavar="SRC", help="Sending node."),
    dst: int = typer.Argument(..., metavar="DST", help="Receiving node."),
    rate: Optional[str] = typer.Argument(None, metavar="[RATE]", help="100mbit, 1gbit, ... or 'off'; a shaped pair changes rate at once."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Play a rate trace (YAML/JSON: points: [{t: seconds, rate: 100mbit}, ...]) and return when it ends."),
    both: bool = typer.Option(False, "--both", help="Both directions (SRC -> DST and DST -> SRC)."),
    net: int = typer.Option(0, "--net", min=0, max=1, help="Network (0: eth0, 1: eth1)."),
) -> None:
    """Limit the traffic from SRC to DST to RATE (htb class on SRC's interface, u32 filter on DST's address)."""
    from ds_pipemorph.lab import Lab, format_rate, load_rate_trace

    with user_errors():
        if (rate is None) == (trace is None):
            raise BadInput("give either RATE or --trace FILE")
        lab = Lab.attach(lab_id)
        if trace is not None:
            player = lab.play(src, dst, load_rate_trace(str(trace)), net, both)
            with _trace_errors():
                for t, _ in _follow(player):
                    console.print(f"t={t:.2f} s: {src}->{dst} at {format_rate(lab.rate(src, dst, net))}")
            return
        if rate.strip().lower() == "off":
            lab.unshape(src, dst, net, both)
            console.print(f"{src}->{dst}{' and back' if both else ''}: unshaped")
        else:
            lab.shape(src, dst, rate, net, both)
            console.print(f"{src}->{dst}{' and back' if both else ''}: {format_rate(lab.rate(src, dst, net))}")


def _follow(player):
    """Yield each point of a playing trace as it is applied; Ctrl-C stops the trace."""
    seen = 0
    try:
        while player.running or seen < len(player.applied):
            while seen < len(player.applied):
                seen += 1
                yield player.applied[seen - 1]
            player.join(0.05)
    finally:
        player.stop()


@contextlib.contextmanager
def _trace_errors() -> Iterator[None]:
    """A rate trace that failed while playing: one sentence on stderr and exit code 1."""
    from ds_pipemorph.lab.trace import TraceFailed

    try:
        yield
    except TraceFailed as e:
        err_console.print(f"error: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command("link")
def link(
    lab_id: str = typer.Argument(..., metavar="LAB"),
    node: int = typer.Argument(..., metavar="NODE"),
    state: str = typer.Argument(..., metavar="down|up"),
    net: int = typer.Option(0, "--net", min=0, max=1, help="Network (0: eth0, 1: eth1)."),
) -> None:
    """Take a node's interface down (a real link failure) or bring it back up."""
    from ds_pipemorph.lab import Lab

    with user_errors():
        if state not in ("down", "up"):
            raise BadInput(f"link state '{state}': write down or up")
        lab = Lab.attach(lab_id)
        (lab.link_up if state == "up" else lab.link_down)(node, net)
    console.print(f"node {node} {lab.ifname(net)}: {state}")


@app.command("run", context_settings=_PASS)
def run(
    lab_id: str = typer.Argument(..., metavar="LAB"),
    node: int = typer.Argument(..., metavar="NODE"),
    cmd: List[str] = typer.Argument(..., metavar="-- CMD...", help="The command, after `--`."),
) -> None:
    """Run CMD in a node (`ip netns exec`) with GLOO_SOCKET_IFNAME set to the node's interface; exits with its code."""
    from ds_pipemorph.lab import Lab

    with user_errors():
        lab = Lab.attach(lab_id)
        full = lab.command(node, cmd)
    code = subprocess.call(full, env={**os.environ, **lab.node_env(node)})
    raise typer.Exit(code)


def _pairs(specs: List[str], what: str, nodes: int) -> list[tuple[int, int, bool, str]]:
    out = []
    for s in specs:
        m = _PAIR.match(s.strip())
        if not m:
            raise BadInput(f"{what} '{s}': write SRC-DST:VALUE (one direction) or SRC=DST:VALUE (both), e.g. 1=2:100mbit")
        a, b = int(m.group(1)), int(m.group(3))
        for k in (a, b):
            if k >= nodes:
                raise BadInput(f"{what} '{s}': node {k} is not one of the {nodes} nodes (0..{nodes - 1})")
        out.append((a, b, m.group(2) == "=", m.group(4)))
    return out


def _fill(cmd: List[str], lab, node: int) -> list[str]:
    repl = {"{node}": str(node), "{nodes}": str(lab.nodes), "{addr}": lab.addr(node),
            "{master_addr}": lab.addr(0), "{ifname}": lab.ifname(0)}
    out = []
    for arg in cmd:
        for k, v in repl.items():
            arg = arg.replace(k, v)
        out.append(arg)
    return out


STOP_GRACE_S = 10.0  # a stopped job's nodes get this long to end in order before they are killed


@app.command("launch", context_settings=_PASS)
def launch(
    nodes: int = typer.Option(..., "--nodes", min=1, help="How many nodes."),
    cmd: List[str] = typer.Argument(..., metavar="-- CMD...", help="Run in every node, after `--`; {node}, {nodes}, {addr}, {master_addr} (node 0), {ifname} are filled in."),
    shape_: List[str] = typer.Option([], "--shape", help="SRC-DST:RATE (one direction) or SRC=DST:RATE (both), repeatable."),
    trace: List[str] = typer.Option([], "--trace", help="SRC-DST:FILE or SRC=DST:FILE: play a rate trace on the pair while the job runs."),
    networks: int = typer.Option(1, "--networks", min=1, max=2, help="2 adds a second network (eth1, 198.19.0.x)."),
    name: Optional[str] = typer.Option(None, "--name", help="Lab name (1-8 lowercase letters or digits; default: random)."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Write each node's output to DIR/node{k}.log instead of the terminal."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1.0, help="Seconds the job may take; then every node is stopped."),
) -> None:
    """Build a lab, run CMD in every node at once (e.g. torchrun --node_rank {node}), remove the lab when the job ends."""
    from ds_pipemorph.lab import Lab, load_rate_trace, parse_rate

    with user_errors():
        if logs is not None:
            check_writable_dir(logs, "--logs")
        shapes = _pairs(shape_, "--shape", nodes)
        traces = [(a, b, both, load_rate_trace(f)) for a, b, both, f in _pairs(trace, "--trace", nodes)]
        lab = Lab(nodes=nodes, networks=networks, **({"lab_id": name} if name else {}))
        for _, _, _, r in shapes:
            parse_rate(r)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the clean-up below
        lab.up()
    files = []
    # The lab is down (below) before a Ctrl-C is reported.
    with stopped_by_signal("pipemorph lab launch", done="every node's command was stopped and the lab removed"):
        try:
            with user_errors():
                for a, b, both, r in shapes:
                    lab.shape(a, b, r, both=both)
                for a, b, both, tr in traces:
                    lab.play(a, b, tr, both=both)
                if logs is not None:
                    try:
                        logs.mkdir(parents=True, exist_ok=True)
                        files = [open(logs / f"node{k}.log", "w") for k in range(nodes)]
                    except OSError as e:
                        raise BadInput(f"--logs: cannot write the node logs in '{logs}' ({e.strerror})") from None
            procs = [lab.popen(k, _fill(cmd, lab, k), env={**os.environ, **lab.node_env(k)},
                               stdout=files[k] if files else None, stderr=subprocess.STDOUT if files else None)
                     for k in range(nodes)]
            failed = _wait_all(procs, timeout)
        finally:
            stopped = sys.exc_info()[0] is KeyboardInterrupt  # a Ctrl-C or SIGTERM: the ranks stop in order
            with _trace_errors():
                lab.down(grace_s=STOP_GRACE_S if stopped else 0.0)
            for f in files:
                f.close()
    code, message = _verdict(failed, timeout)
    if message:
        err_console.print(message, markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _wait_all(procs, timeout: float) -> Optional[dict[int, int]]:
    """Wait until every node's command succeeded, one failed, or ``timeout`` seconds passed.
    Returns {node: exit code} of the nodes that failed ({} when all succeeded; a negative code -N:
    killed by signal N); None on timeout. The lab stops the other nodes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        codes = [p.poll() for p in procs]
        failed = {k: c for k, c in enumerate(codes) if c not in (None, 0)}
        if failed or all(c == 0 for c in codes):
            return failed
        time.sleep(0.2)
    return None


def _verdict(failed: Optional[dict[int, int]], timeout: float) -> tuple[int, Optional[str]]:
    """The exit code of `lab launch` and what it says: the first failed node's exit code, 128 + N
    for a node killed by signal N (as a shell reports it), 1 on timeout."""
    if failed is None:
        return 1, f"the job timed out after {timeout:g} s; every node was stopped"
    if not failed:
        return 0, None
    node = min(failed)
    code = failed[node]
    if code > 0:
        return code, f"the job failed in node {node} (exit code {code})"
    return 128 - code, f"node {node} was killed by signal {-code} ({_signal_name(-code)})"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return "unknown signal"


@app.command("down")
def down(
    labs: List[str] = typer.Argument(None, metavar="[LAB]...", help="Labs to remove (default with --all: every lab)."),
    all_: bool = typer.Option(False, "--all", help="Remove every lab namespace on this machine (also leftovers)."),
) -> None:
    """Remove labs: kill what runs in their nodes, delete their namespaces (links and qdiscs go with them)."""
    from ds_pipemorph.lab import names
    from ds_pipemorph.lab.topology import teardown

    with user_errors():
        if not labs and not all_:
            raise BadInput("name the labs to remove, or give --all")
        prefixes = [names.PREFIX] if all_ else [names.lab_prefix(names.check_lab_id(x)) for x in labs]
        gone = [ns for p in prefixes for ns in teardown(p)]
    console.print(f"removed {len(gone)} namespaces" + (f": {', '.join(gone)}" if gone else ""))
