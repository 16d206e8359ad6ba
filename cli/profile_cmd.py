"""``pipemorph profile-links`` and ``pipemorph profile-stages``: measure a profile's ``links_ms`` and
``compute_ms`` (methods: ``ds_pipemorph.profiling.linkmeasure`` and ``ds_pipemorph.profiling.stages``)."""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ds_pipemorph.fileio import BadInput

from .common import announce, check_outputs, console, err_console, parse_floats, user_errors, write_outputs

MIB = 1024 * 1024



def _progress() -> Progress:
    """Redrawn only when a step ends: no refresh thread competes for the GIL while a link is timed."""
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True, auto_refresh=False)


def profile_links(
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Write links_ms here: a profile part (stages + links_ms), or with --merge the merged profile; with --all-pairs the link matrix (.json = JSON, else YAML)."),
    all_pairs: bool = typer.Option(False, "--all-pairs", help="Measure every pair of ranks, not only (r, r+1), in round-robin rounds of disjoint pairs; -o writes the link matrix that `pipemorph place` reads."),
    merge: Optional[Path] = typer.Option(None, "--merge", help="Profile (or part) whose links_ms to replace, keeping every other key; written back to it unless --out is given."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write the full report (JSON): samples per link (or pair), direction and size, and the latency + size/bandwidth fit."),
    sizes: str = typer.Option("4K,16K,64K,256K,1M,4M,16M", "--sizes", help="Message sizes (K = 1024 bytes, M = 1024 K)."),
    reps: int = typer.Option(5, "--reps", min=1, help="Timed exchanges per direction and size."),
    warmup: int = typer.Option(1, "--warmup", min=1, help="Untimed exchanges before them (connection set-up, layout header)."),
    slow_factor: float = typer.Option(2.0, "--slow-factor", min=1.0, help="Mark links (pairs) whose latency is this many times the median's, or whose bandwidth is this many times lower."),
    absolute: bool = typer.Option(False, "--absolute", help="links_ms = absolute one-way latency instead of the extra over the fastest link."),
    inject_links_ms: Optional[str] = typer.Option(None, "--inject-links-ms", help="TESTING ONLY: delay every message on link i by this many ms (DelayInjector, e.g. 0,0,30) to check the measurement."),
    inject_pairs_ms: Optional[str] = typer.Option(None, "--inject-pairs-ms", help="TESTING ONLY, with --all-pairs: delay every message between two ranks by this many ms (DelayInjector, e.g. 0-2:30,1-3:5) to check the measurement."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds any wait on another rank may take."),
) -> None:
    """Measure latency and bandwidth of every link (r, r+1) in both directions, or with --all-pairs of every pair of ranks; run it like a training job (one rank per stage)."""
    from ds_pipemorph.profiling.distenv import job_env, require_launcher
    from ds_pipemorph.profiling.linkfit import parse_sizes
    from ds_pipemorph.profiling.pairs import check_pair_ranks, parse_pair_delays
    from ds_pipemorph.profiling.profileparts import load_base

    with user_errors():
        check_outputs({"--out": out, "--report": report} if out is not None or all_pairs else {"--merge": merge, "--report": report})
        size_list = parse_sizes(sizes)
        inject = parse_floats(inject_links_ms, "--inject-links-ms")
        pair_delays = parse_pair_delays(inject_pairs_ms)
        if all_pairs:
            _refuse_with_all_pairs(merge, inject_links_ms, absolute)
        elif pair_delays is not None:
            raise BadInput("--inject-pairs-ms needs --all-pairs (pipeline links take --inject-links-ms)")
        env = job_env()
        links = env.world_size - 1
        base = None
        if all_pairs:
            if pair_delays is not None and env.world_size >= 2:
                check_pair_ranks(pair_delays, env.world_size)
        else:
            if inject is not None and len(inject) != links:
                raise BadInput(f"--inject-links-ms: expected {links} values (one per link of {env.world_size} ranks), got {len(inject)}")
            base = load_base(str(merge), env.world_size, f"this job ({env.world_size} ranks)") if merge else None
        require_launcher(env, "profile-links")
    if all_pairs:
        _run_pairs(env, size_list, reps, warmup, slow_factor, pair_delays, timeout, out, report)
    else:
        _run_links(env, size_list, reps, warmup, slow_factor, absolute, inject, timeout, base, out or merge, report)


def _write_and_show(outputs: dict, report, rep: dict, table) -> None:
    """Rank 0: the outputs (and the report, if asked) written atomically, the table, what was written."""
    if report:
        outputs[str(report)] = json.dumps(rep, indent=2) + "\n"
    write_outputs(outputs)
    console.print(table)
    announce(outputs)


def _rank_error(env, e: Exception) -> typer.Exit:
    """One line naming the rank; exit code 2 for bad input, 1 for a failed measurement."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    err_console.print(f"error: rank {env.rank}: {msg}", markup=False, soft_wrap=True)
    return typer.Exit(2 if isinstance(e, BadInput) else 1)


def _run_links(env, size_list, reps, warmup, slow_factor, absolute, inject, timeout, base, dest, report) -> None:
    import torch.distributed as dist

    from ds_pipemorph.profiling.distenv import close_group, init_group
    from ds_pipemorph.profiling.linkfit import human_bytes
    from ds_pipemorph.profiling.linkreport import build_report
    from ds_pipemorph.profiling.linkmeasure import make_transport, measure_links, steps
    from ds_pipemorph.profiling.profileparts import merged, render
    from ds_pipemorph.runtime.transport.protocol import TransportError

    tr = None
    try:
        device = init_group(env, timeout)
        hosts: list = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        tr = make_transport(env.rank, env.world_size, device, timeout, inject)
        total = (env.world_size - 1) * len(steps(size_list))
        if env.rank == 0:
            console.print(f"profiling {env.world_size - 1} links of {env.world_size} stages over "
                          f"{dist.get_backend()} ({len(size_list)} sizes, {reps} reps)"
                          + (f"; INJECTED delays {inject} ms (testing only)" if inject else ""))
            with _progress() as bar:
                task = bar.add_task("links", total=total)

                def step(link, kind, size):
                    what = kind if size is None else f"{kind} {human_bytes(size)}"
                    bar.update(task, advance=1, description=f"link {link} {what}", refresh=True)

                samples = measure_links(tr, env.rank, env.world_size, device, size_list, warmup, reps, step)
        else:
            samples = measure_links(tr, env.rank, env.world_size, device, size_list, warmup, reps)
        if env.rank == 0:
            rep = build_report(samples, size_list, absolute=absolute, slow_factor=slow_factor,
                               backend=dist.get_backend(), hosts=hosts, warmup=warmup, reps=reps, inject_ms=inject)
            outputs = {}
            if dest:
                outputs[str(dest)] = render(merged(base, env.world_size, links_ms=rep["links_ms"]), str(dest))
            _write_and_show(outputs, report, rep, _links_table(rep, max(size_list)))
        dist.barrier()
    except (TransportError, RuntimeError, BadInput) as e:
        raise _rank_error(env, e) from None
    finally:
        if tr is not None:
            tr.close()
        close_group()


def _refuse_with_all_pairs(merge, inject_links_ms, absolute) -> None:
    if merge is not None:
        raise BadInput("--merge replaces a profile's links_ms, but --all-pairs writes a link matrix: give -o MATRIX instead")
    if inject_links_ms is not None:
        raise BadInput("--inject-links-ms delays pipeline links; with --all-pairs inject on pairs of ranks with --inject-pairs-ms (e.g. 0-2:30)")
    if absolute:
        raise BadInput("--absolute chooses the form of links_ms; a link matrix always holds the absolute one-way latency")


def _run_pairs(env, size_list, reps, warmup, slow_factor, inject, timeout, out, report) -> None:
    """``--all-pairs``: every pair in round-robin rounds; rank 0 writes the link matrix and the report."""
    import torch.distributed as dist

    from ds_pipemorph.fileio import dump
    from ds_pipemorph.profiling.distenv import close_group, init_group
    from ds_pipemorph.profiling.linkfit import human_bytes
    from ds_pipemorph.profiling.linkreport import build_pair_report, link_matrix
    from ds_pipemorph.profiling.linkmeasure import measure_pairs, steps
    from ds_pipemorph.profiling.pairs import round_robin
    from ds_pipemorph.runtime.transport.protocol import TransportError

    W = env.world_size
    rounds = round_robin(W)
    try:
        device = init_group(env, timeout)
        hosts: list = [None] * W
        dist.all_gather_object(hosts, socket.gethostname())
        if env.rank == 0:
            shown = ", ".join(f"{a}-{b}: {c:g}" for (a, b), c in sorted(inject.items())) if inject else ""
            console.print(f"profiling all {W * (W - 1) // 2} pairs of {W} ranks in {len(rounds)} rounds of up to "
                          f"{W // 2} pairs at a time over {dist.get_backend()} ({len(size_list)} sizes, {reps} reps)"
                          + (f"; INJECTED delays ({shown}) ms (testing only)" if inject else ""))
            with _progress() as bar:
                task = bar.add_task("pairs", total=len(rounds) * len(steps(size_list)))

                def step(rnd, kind, size):
                    what = kind if size is None else f"{kind} {human_bytes(size)}"
                    bar.update(task, advance=1, description=f"round {rnd + 1}/{len(rounds)} {what}", refresh=True)

                samples = measure_pairs(env.rank, W, device, size_list, warmup, reps, timeout, inject, step)
        else:
            samples = measure_pairs(env.rank, W, device, size_list, warmup, reps, timeout, inject)
        if env.rank == 0:
            rep = build_pair_report(samples, size_list, world=W, rounds=rounds, slow_factor=slow_factor,
                                    backend=dist.get_backend(), hosts=hosts, warmup=warmup, reps=reps, inject_ms=inject)
            outputs = {}
            if out:
                outputs[str(out)] = dump(link_matrix(rep), str(out).lower().endswith(".json"))
            _write_and_show(outputs, report, rep, _pairs_table(rep, max(size_list)))
        dist.barrier()
    except (TransportError, RuntimeError, BadInput) as e:
        raise _rank_error(env, e) from None
    finally:
        close_group()


PAIRS_SHOWN = 64  # more pairs than this: the table lists the slow ones only


def _pairs_table(rep: dict, big: int) -> Table:
    from ds_pipemorph.profiling.linkfit import human_bytes

    pairs = rep["pairs"]
    shown = pairs if len(pairs) <= PAIRS_SHOWN else [e for e in pairs if e["slow"]]
    which = "" if shown is pairs else f"; {len(shown)} slow of {len(pairs)} pairs shown"
    t = Table(title=f"pairs of ranks, one-way (latency = half the ping-pong round trip; slow: "
                    f"{rep['slow_factor']:g}x median{which})", title_justify="left")
    hosts = len({h for e in pairs for h in e["hosts"]}) > 1
    cols = ["pair"] + (["hosts"] if hosts else []) + ["round", "latency ms", "GB/s a>b / b>a",
                                                      f"{human_bytes(big)} ms a>b / b>a", "slow"]
    for col in cols:
        t.add_column(col, justify="right")
    for e in shown:
        d, u = e["directions"]["down"], e["directions"]["up"]
        bw = "/".join("-" if x["fit"]["bandwidth_gbps"] is None else f"{x['fit']['bandwidth_gbps']:.2f}" for x in (d, u))
        big_ms = "/".join(f"{x['median_ms'].get(str(big), float('nan')):.1f}" for x in (d, u))
        a, b = e["ranks"]
        row = [f"{a}-{b}"] + ([" / ".join(e["hosts"])] if hosts else [])
        row += [str(e["round"]), f"{e['latency_ms']['median']:.3f}", bw, big_ms,
                f"[red]SLOW[/red] {e['slow']}" if e["slow"] else ""]
        t.add_row(*row)
    return t


def _links_table(rep: dict, big: int) -> Table:
    from ds_pipemorph.profiling.linkfit import human_bytes

    t = Table(title=f"links, one-way (links_ms = {rep['links_ms_mode']} latency; slow: {rep['slow_factor']:g}x median)",
              title_justify="left")
    hosts = len({h for e in rep["links"] for h in e["hosts"]}) > 1
    cols = ["link"] + (["hosts"] if hosts else []) + ["latency ms", "links_ms", "GB/s dn/up", f"{human_bytes(big)} ms dn/up", "slow"]
    for col in cols:
        t.add_column(col, justify="right")
    for e in rep["links"]:
        d, u = e["directions"]["down"], e["directions"]["up"]
        bw = "/".join("-" if x["fit"]["bandwidth_gbps"] is None else f"{x['fit']['bandwidth_gbps']:.2f}" for x in (d, u))
        big_ms = "/".join(f"{x['median_ms'].get(str(big), float('nan')):.1f}" for x in (d, u))
        row = [f"{e['link']} ({e['link']}-{e['link'] + 1})"] + ([" / ".join(e["hosts"])] if hosts else [])
        row += [f"{e['latency_ms']['median']:.3f}", f"{e['links_ms']:.3f}", bw, big_ms,
                f"[red]SLOW[/red] {e['slow']}" if e["slow"] else ""]
        t.add_row(*row)
    return t


def profile_stages(
    model: str = typer.Option(..., "--model", help="module:function (or file.py:function) returning a deepspeed.pipe.PipelineModule or a list of per-stage torch modules (with --per-layer: a list of layers)."),
    input_shape: Optional[str] = typer.Option(None, "--input-shape", help="Shape of a random float input micro-batch, e.g. 8,64."),
    sample: Optional[str] = typer.Option(None, "--sample", help="module:function returning one micro-batch as (inputs, labels), like DeepSpeed's data iterator."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Write the profile here (links_ms from --merge, else zeros); with --per-layer the layer profile."),
    merge: Optional[Path] = typer.Option(None, "--merge", help="Profile (or part, e.g. from profile-links) whose compute_ms to replace, keeping every other key; written back to it unless --out is given."),
    microbatches: Optional[int] = typer.Option(None, "--microbatches", min=1, help="Micro-batches per iteration in the profile (default: the merged profile's, else 4 x stages)."),
    reps: int = typer.Option(5, "--reps", min=1, help="Timed rounds per stage (the median is kept)."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="Untimed rounds before them."),
    split: Optional[str] = typer.Option(None, "--split", help="runtime (the engine's B/W split, default when available) or autograd (grad with inputs=; W approximate)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda[:i] (default: cuda when available)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads for torch, as a training rank has them (torchrun sets OMP_NUM_THREADS=1); default: torch's current setting."),
    per_layer: bool = typer.Option(False, "--per-layer", help="Time every layer instead of every stage, with its activation, stash and parameter sizes; -o writes a layer profile that `pipemorph partition` reads (docs/partition.md)."),
    stages: Optional[int] = typer.Option(None, "--stages", min=1, help="With --per-layer: the layer profile's stage count (default: the PipelineModule's; required for a list of layers)."),
) -> None:
    """Time forward (F), backward-input (B) and backward-weight (W) of every stage (or with --per-layer every layer) of a model in this process."""
    import torch

    from ds_pipemorph.profiling.pipecapture import build_stages, load_callable
    from ds_pipemorph.profiling.profileparts import load_base, merged, render
    from ds_pipemorph.profiling.stages import profile_stages as run_profile

    with user_errors():
        check_outputs({"--out": out} if out is not None or per_layer else {"--merge": merge})
        if (input_shape is None) == (sample is None):
            raise BadInput("give exactly one of --input-shape and --sample")
        if split not in (None, "runtime", "autograd"):
            raise BadInput(f"--split: '{split}' is neither runtime nor autograd")
        if per_layer and merge is not None:
            raise BadInput("--merge replaces a stage profile's compute_ms, but --per-layer writes a layer profile: give -o LAYERS instead")
        if stages is not None and not per_layer:
            raise BadInput("--stages is for --per-layer; a stage profile has the model's own stage count")
        try:
            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError:
            raise BadInput(f"--device: '{device}' is not a torch device (cpu, cuda, cuda:1)") from None
        if threads:
            torch.set_num_threads(threads)
        if input_shape is not None:
            try:
                shape = [int(x) for x in input_shape.split(",")]
            except ValueError:
                shape = []
            if not shape or any(d < 1 for d in shape):
                raise BadInput(f"--input-shape: '{input_shape}' is not a comma-separated list of positive sizes")
            inputs, labels = torch.randn(*shape), None
        else:
            batch = load_callable(sample, "--sample")()
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise BadInput("--sample: the function must return one micro-batch as (inputs, labels)")
            inputs, labels = batch
        factory = load_callable(model, "--model")
        if per_layer:
            return _profile_layers(factory, inputs, labels, stages, microbatches, out, warmup, reps, split, dev)
        modules, loss_fn, parts = build_stages(factory)
        stages = len(modules)
        base = load_base(str(merge), stages, f"the model ({stages} stages)") if merge else None
        n = microbatches or (base or {}).get("microbatches") or 4 * stages
        with _progress() as bar:
            task = bar.add_task("stages", total=stages)
            times, used = run_profile(modules, inputs, labels, loss_fn, warmup=warmup, reps=reps, split=split,
                                      device=dev, on_stage=lambda s: bar.update(task, advance=1, description=f"stage {s}", refresh=True))
        compute = {
            "forward": [round(t.forward_ms, 4) for t in times],
            "backward_input": [round(t.backward_input_ms, 4) for t in times],
            "backward_weight": [round(t.backward_weight_ms, 4) for t in times],
        }
        extra = {}
        if not (base and "memory" in base) and all(t.activation_bytes > 0 for t in times):
            from ds_pipemorph.plan.ir.profile import memory_in_mb  # capacity: what stock 1F1B holds

            extra["memory"] = memory_in_mb([t.activation_bytes for t in times], [t.weight_bytes for t in times],
                                           [stages - s for s in range(stages)])
        data = merged(base, stages, microbatches=n, compute_ms=compute,
                      links_ms=None if base and "links_ms" in base else [0.0] * (stages - 1), **extra)
        dest = out or merge
        outputs = {str(dest): render(data, str(dest))} if dest else {}
        write_outputs(outputs)
    whence = "--microbatches" if microbatches else ("the merged profile's" if (base or {}).get("microbatches")
                                                    else f"4 x {stages} stages, the default")
    console.print(f"{stages} stages on {dev}, {torch.get_num_threads()} thread(s), median of {reps} rounds, "
                  f"B/W split: {used}; {n} micro-batches per iteration in the profile ({whence}: "
                  f"`pipemorph plan` plans for this count unless given --microbatches)")
    t = Table()
    for col in ("stage", "layers", "params", "F ms", "B ms", "W ms", "F keeps MB", "B keeps MB"):
        t.add_column(col, justify="right")
    for s, x in enumerate(times):
        layers = f"{parts[s]}-{parts[s + 1] - 1}" if parts else "-"
        t.add_row(str(s), layers, f"{x.params:,}", f"{x.forward_ms:.3f}", f"{x.backward_input_ms:.3f}",
                  f"{x.backward_weight_ms:.3f}", f"{x.activation_bytes / MIB:.2f}", f"{x.weight_bytes / MIB:.2f}")
    console.print(t)
    console.print("F keeps: the activations one micro-batch's F saves for B; B keeps: what B leaves for W of them "
                  "(the profile's memory.activation_mb and weight_mb, with capacity_mb what stock 1F1B holds)",
                  soft_wrap=True)
    announce(outputs)


def _profile_layers(factory, inputs, labels, stages, microbatches, out, warmup, reps, split, dev) -> None:
    """``--per-layer``: F, B, W and sizes of every layer, written as a layer profile (called where bad
    input is one sentence with exit code 2; nothing is written unless every layer was measured)."""
    import torch

    from ds_pipemorph.profiling.layers import layer_profile_data, model_layers, profile_layers
    from ds_pipemorph.profiling.profileparts import render

    layers, loss_fn, model_stages = model_layers(factory)
    S = stages or model_stages
    if S is None:
        raise BadInput("--per-layer: give --stages (the model is a list of layers, not a PipelineModule with num_stages)")
    if len(layers) < S:
        raise BadInput(f"--per-layer: the model has {len(layers)} layers, too few for {S} stages (at least one per stage)")
    with _progress() as bar:
        task = bar.add_task("layers", total=len(layers))
        costs, used = profile_layers(layers, inputs, labels, loss_fn, warmup=warmup, reps=reps, split=split, device=dev,
                                     on_layer=lambda i: bar.update(task, advance=1, description=f"layer {i}", refresh=True))
    data = layer_profile_data(costs, S, microbatches or 4 * S)
    outputs = {str(out): render(data, str(out))} if out else {}
    write_outputs(outputs)
    console.print(f"{len(layers)} layers on {dev}, {torch.get_num_threads()} thread(s), median of {reps} rounds, "
                  f"B/W split: {used}; memory MB = 4 x parameter bytes (parameters, gradients, Adam's two moments)")
    t = Table()
    for col in ("layer", "kind", "params", "F ms", "B ms", "W ms", "out MB", "stash MB", "memory MB"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for i, c in enumerate(costs):
        t.add_row(str(i), c.name, f"{c.params:,}", f"{c.forward_ms:.3f}", f"{c.backward_input_ms:.3f}",
                  f"{c.backward_weight_ms:.3f}", f"{c.activation_mb:.3f}", f"{c.stash_mb:.3f}", f"{c.memory_mb:.3f}")
    console.print(t)
    announce(outputs)
