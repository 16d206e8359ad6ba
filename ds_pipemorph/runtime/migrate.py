"""Live layer migration: move layers between neighbouring stages at an iteration boundary, no restart.

Every rank of the job calls ``LayerMigrator.migrate(engine, new_parts)`` between two ``train_batch``
calls with the same ``new_parts``. For each layer that changes stage, the rank holding it sends,
to the neighbouring stage of its own data-parallel replica, everything the layer's training depends
on: parameters (and their ``requires_grad``), buffers, gradients if any are held, the optimizer's
per-parameter state (Adam's moments and step) and the index of the optimizer group the parameter
is in. The receiving rank builds the layer from its spec (``LayerSpec.build()``, or the module
object the spec list holds), loads that state, and only then do all ranks vote.

Two phases, so a failure changes nothing (``runtime.transfer``: the groups, tags, vote and blobs
migration shares with re-mapping): the transfer and the build happen beside the running partition
(nothing of it is touched); a vote over every rank follows, and only if every rank succeeded does
each rank commit: drop the layers it gave away, install the ones it received, rebuild its forward
list, module order and optimizer groups, and forget the activation layouts its links knew (the
boundary's shapes may differ). Otherwise every rank keeps the old partition and training goes on.

Exactness: Adam's update is element-wise per parameter, data-parallel and tied-weight reductions are
element-wise sums, so a layer trained on another stage gets exactly the numbers it would have got
where it was. One optimizer detail matters: DeepSpeed's ``FusedAdam`` counts steps in the state of
the *last* parameter of each group (the others keep the count they were created with). After a
migration, with ``FusedAdam``, every parameter's ``step`` is set to its group's count (the largest
one in the group), so whichever parameter is now last carries the right count; optimizers that
count per parameter (torch's Adam) keep each parameter's own. Gradient clipping: DeepSpeed's norm
counts the parameters of one rank (stage 0's), so from the first migration on the engine clips by
the parameters that rank held before it, wherever they are now (``runtime.clip``).

Not moved: tied layers (``TiedLayerSpec``: their reduction groups are fixed at start-up; a
partition that moves one is refused). Random numbers need nothing moved with DeepSpeed's
``seed_layers``: ``PipelineModule`` seeds each layer by its index and its forward count, equal on
every stage at a boundary; without it, torch's one generator per process serves whatever layers
the process holds, so a moved dropout layer draws from its new stage's stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ..fileio import BadInput, first_line
from ..plan.partition.parts import check_parts, layer_moves
from . import flat_optimizer
from .clip import freeze_clip_set
from .transfer import (Purpose, Transfer, blob_tags, from_blob, packed_state, recv_blob, rng_kept,
                       send_blob, to_blob, unpacked_state)


@dataclass
class MigrationReport:
    """What one migration attempt did, the same on every rank except the byte counts."""

    ok: bool
    before: list[int]
    after: list[int]  # the partition in force now (``before`` when the attempt failed)
    moved: dict[int, tuple[int, int]]  # layer -> (stage it left, stage it joined)
    seconds: float
    bytes_sent: int = 0  # by this rank
    bytes_received: int = 0
    reason: str = ""  # why this rank voted no (empty when it voted yes)
    attempt: int = 0

    def describe(self) -> str:
        if not self.before or self.before == self.after and self.ok:
            return "migration: nothing to move"
        what = "moved" if self.ok else "kept the old partition after a failed attempt to move"
        return (f"migration {self.attempt}: {what} layers {sorted(self.moved)} ({self.before} -> "
                f"{self.after if self.ok else self.before}) in {self.seconds * 1e3:.0f} ms")


@dataclass
class _Incoming:
    layer: int
    func: object  # what the forward list calls: the module, or the spec's callable
    module: Optional[torch.nn.Module]
    groups: dict[torch.nn.Parameter, int] = field(default_factory=dict)  # parameter -> optimizer group
    states: dict[torch.nn.Parameter, dict] = field(default_factory=dict)


class MigrationFailed(RuntimeError):
    """This rank's part of an attempt went wrong (its vote is no)."""


def check_movable(specs: list, moves: dict, new: list[int]) -> None:
    """BadInput if a layer that would move is tied (``TiedLayerSpec``): the groups that reduce a
    tied weight's gradient are formed at start-up from the stages holding it."""
    tied = [layer for layer in sorted(moves) if isinstance(specs[layer], TiedLayerSpec)]
    if tied:
        raise BadInput(f"parts {new}: layer {tied[0]} is tied ({specs[tied[0]].key!r}); tied layers "
                       f"stay on the stages that share them")


class LayerMigrator:
    """Runs migrations for one engine; every rank builds one and calls ``migrate`` collectively.

    ``transfer``: the engine's groups and attempts (``runtime.transfer``), shared with re-mapping."""

    def __init__(self, transfer: Transfer):
        self.transfer = transfer
        self.reports: list[MigrationReport] = []
        self._flat = None  # (snapshot, step counts) of a flat optimizer during an attempt

    def vote_group(self):
        """The gloo group every rank votes in (formed here if no transfer formed it yet; every
        rank calls this together)."""
        return self.transfer.vote_group()

    def migrate(self, engine, new_parts: list[int]) -> MigrationReport:
        pm = engine.module
        old = list(pm.parts)
        new = check_parts([int(p) for p in new_parts], layers=old[-1], stages=len(old) - 1)
        moves = layer_moves(old, new)
        check_movable(pm._layer_specs, moves, new)
        transfer = self.transfer
        if not moves:
            return MigrationReport(True, old, old, {}, 0.0, attempt=transfer.attempts)
        group = transfer.transfer_group()
        freeze_clip_set(engine, transfer.vote_group())  # clipping keeps counting what it counted so far
        attempt = transfer.next_attempt()
        t0 = time.perf_counter()
        report = MigrationReport(False, old, old, moves, 0.0, attempt=attempt)
        incoming: list[_Incoming] = []
        try:
            incoming = self._exchange(engine, group, moves, attempt, report)
            ok = 1
        except Exception as e:  # noqa: BLE001 - any failure here is a no vote, never a rank missing from the vote
            report.reason = first_line(e, with_type=True)
            ok = 0
        try:
            if transfer.vote(ok):
                _commit(engine, new, moves, incoming, self._flat)
                report.ok, report.after = True, new
        finally:
            self._flat = None  # the snapshot holds the stage's masters and the layers that left
        report.seconds = time.perf_counter() - t0
        self.reports.append(report)
        return report

    # -- transfer -------------------------------------------------------------------------------
    def _exchange(self, engine, group, moves, attempt: int, report: MigrationReport) -> list[_Incoming]:
        stage, grid, timeout = engine.stage_id, engine.grid, self.transfer.timeout
        self._flat = None  # bf16/ZeRO: the stage's masters and states, read before anything moves
        if flat_optimizer.is_flat(engine.optimizer) and any(stage in ab for ab in moves.values()):
            self._flat = (flat_optimizer.snapshot(engine), flat_optimizer.steps(engine.optimizer))
        forward, backward = blob_tags(Purpose.MIGRATION, attempt)  # to the next stage, to the previous one
        drop = self.transfer.drops(attempt)
        sends = []
        for peer_stage, tag in ((stage + 1, forward), (stage - 1, backward)):
            layers = sorted(l for l, (a, b) in moves.items() if a == stage and b == peer_stage)
            if layers:
                blob = _pack(engine, layers, self._flat[0] if self._flat else None)
                report.bytes_sent += blob.numel()
                sends += send_blob(blob, grid.stage_to_global(peer_stage), group, tag, drop)
        incoming = []
        for peer_stage, tag in ((stage - 1, forward), (stage + 1, backward)):
            layers = sorted(l for l, (a, b) in moves.items() if a == peer_stage and b == stage)
            if layers:
                blob = recv_blob(grid.stage_to_global(peer_stage), group, tag, timeout)
                report.bytes_received += blob.numel()
                incoming += _unpack(engine, layers, blob)
        for work in sends:
            work.wait(timeout)
        return incoming


def _pack(engine, layers: list[int], flat: Optional[dict] = None) -> torch.Tensor:
    """The state of ``layers`` (held by this rank) as one byte tensor; ``flat``: a flat optimizer's
    per-parameter snapshot (``flat_optimizer.snapshot``), sent as the parameters' state."""
    pm, opt = engine.module, engine.optimizer
    if flat is not None:
        group_of = {p: st["group"] for p, st in flat.items()}
    else:
        group_of = {p: g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    out = []
    for layer in layers:
        module = pm._modules.get(str(layer))
        entry = {"layer": layer, "params": {}, "buffers": {}}
        if module is not None:
            for name, p in module.named_parameters():
                state = packed_state(flat[p] if flat is not None and p in flat else opt.state.get(p, {}))
                entry["params"][name] = {
                    "data": p.detach().cpu(), "requires_grad": p.requires_grad, "group": group_of.get(p),
                    "grad": None if p.grad is None else p.grad.detach().cpu(), "state": state}
            entry["buffers"] = {name: b.detach().cpu() for name, b in module.named_buffers()}
        out.append(entry)
    return to_blob(out)


def _unpack(engine, layers: list[int], blob: torch.Tensor) -> list[_Incoming]:
    """Build ``layers`` from their specs and load the state the neighbour sent."""
    entries = from_blob(blob)
    got = [e["layer"] for e in entries]
    if got != layers:
        raise MigrationFailed(f"stage {engine.stage_id}: expected layers {layers} from the neighbour, got {got} "
                              f"(the ranks were given different partitions)")
    groups = len(flat_optimizer._groups(engine.optimizer) if flat_optimizer.is_flat(engine.optimizer)
                 else engine.optimizer.param_groups)
    built = []
    for entry in entries:
        spec = engine.module._layer_specs[entry["layer"]]
        if isinstance(spec, LayerSpec):
            with rng_kept(engine.device):  # initial weights are overwritten: draw no random numbers of training's
                module = spec.build()
        elif isinstance(spec, torch.nn.Module):
            module = spec
        else:  # a callable without parameters
            built.append(_Incoming(entry["layer"], spec, None))
            continue
        module = module.to(engine.device)
        if engine.bfloat16_enabled():  # as DeepSpeed cast the stage's modules at start-up
            module = module.bfloat16()
        elif engine.fp16_enabled():
            module = module.half()
        inc = _Incoming(entry["layer"], module, module)
        params = dict(module.named_parameters())
        if sorted(params) != sorted(entry["params"]):
            raise MigrationFailed(f"layer {entry['layer']}: the built module has parameters {sorted(params)}, "
                                  f"the neighbour sent {sorted(entry['params'])}")
        with torch.no_grad():
            for name, sent in entry["params"].items():
                p = params[name]
                p.copy_(sent["data"])
                p.requires_grad_(sent["requires_grad"])
                p.grad = None if sent["grad"] is None else sent["grad"].to(engine.device)
                if sent["group"] is not None:
                    if sent["group"] >= groups:
                        raise MigrationFailed(f"layer {entry['layer']}: optimizer group {sent['group']} does not "
                                              f"exist on stage {engine.stage_id} ({groups} groups)")
                    inc.groups[p] = sent["group"]
                    inc.states[p] = unpacked_state(sent["state"], engine.device)
            buffers = dict(module.named_buffers())
            for name, b in entry["buffers"].items():
                buffers[name].copy_(b)
        built.append(inc)
    return built


# -- commit ---------------------------------------------------------------------------------------
def _commit(engine, new: list[int], moves, incoming: list[_Incoming], flat=None) -> None:
    """Install the new partition on this rank (everything was built and loaded before the vote;
    a flat optimizer is configured again around the stage's new parameters, ``flat_optimizer``)."""
    pm, opt, stage = engine.module, engine.optimizer, engine.stage_id
    old_funcs = dict(zip(range(pm._local_start, pm._local_stop), pm.forward_funcs))
    leaving = {p for layer, (a, _) in moves.items() if a == stage and str(layer) in pm._modules
               for p in pm._modules[str(layer)].parameters()}
    for layer, (a, _) in moves.items():
        if a == stage:
            pm._modules.pop(str(layer), None)
    new_funcs = {inc.layer: inc.func for inc in incoming}
    for inc in incoming:
        if inc.module is not None:
            pm._modules[str(inc.layer)] = inc.module
            for p in inc.module.parameters():
                p.ds_pipe_replicated = False
    # Module order as DeepSpeed builds it: whatever came before the layers (tied modules, a loss
    # module), then the layers in model order; parameters() and state_dict() follow it.
    items = list(pm._modules.items())
    pm._modules.clear()
    pm._modules.update([(k, v) for k, v in items if not k.isdigit()])
    pm._modules.update(sorted(((k, v) for k, v in items if k.isdigit()), key=lambda kv: int(kv[0])))
    start, stop = new[stage], new[stage + 1]
    pm.forward_funcs = [new_funcs[i] if i in new_funcs else old_funcs[i] for i in range(start, stop)]
    pm.fwd_map = {str(i): n for n, i in enumerate(range(start, stop)) if str(i) in pm._modules}
    pm.parts = list(new)
    pm._set_bounds(start=start, stop=stop)
    if hasattr(engine, "param_names"):  # DeepSpeed's optimizers name parameters from it
        engine.param_names = {p: name for name, p in pm.named_parameters()}
    if flat_optimizer.is_flat(opt):
        if flat is not None:  # this stage gave or took layers: its optimizer is configured again
            snap, step_counts = flat
            groups = {p: st["group"] for p, st in snap.items() if p not in leaving}
            states = {p: st for p, st in snap.items() if p not in leaving}
            for inc in incoming:
                groups.update(inc.groups)
                states.update(inc.states)
            flat_optimizer.rebuild(engine, groups, states, step_counts)
    else:
        _regroup(opt, pm, leaving, incoming)
    if pm.activation_checkpoint_interval > 0:  # DeepSpeed caches which chunks it checkpoints per interval
        pm.is_checkpointable_results_interval = None
        pm._precompute_checkpointable_values()
    engine.reset_activation_shape()  # DeepSpeed's evaluation buffers and the transport's layouts


def _regroup(opt, pm, leaving: set, incoming: list[_Incoming]) -> None:
    """Optimizer groups hold the stage's parameters in module order, with their state; every
    parameter's ``step`` is its group's count, taken before the leaving parameters go (one of them
    may be the one that carried it)."""
    counts = [max([_step(opt.state[p]["step"]) for p in group["params"] if "step" in opt.state.get(p, {})]
                  + [_step(st["step"]) for inc in incoming for q, st in inc.states.items()
                     if inc.groups[q] == g and "step" in st], default=None)
              for g, group in enumerate(opt.param_groups)]
    group_of = {p: g for g, group in enumerate(opt.param_groups) for p in group["params"] if p not in leaving}
    for p in leaving:
        opt.state.pop(p, None)
    for inc in incoming:
        group_of.update(inc.groups)
        for p, state in inc.states.items():
            if state:
                opt.state[p] = state
    order = [p for p in pm.parameters() if p in group_of]
    fused = type(opt).__name__ == "FusedAdam"  # its one step count per group lives in the last parameter
    for g, group in enumerate(opt.param_groups):
        group["params"] = [p for p in order if group_of[p] == g]
        if counts[g] is None or not fused:
            continue
        for p in group["params"]:
            st = opt.state.get(p)
            if st and "step" in st:
                old = st["step"]
                st["step"] = (torch.tensor(counts[g], dtype=old.dtype, device=old.device) if torch.is_tensor(old)
                              else type(old)(counts[g]))


def _step(v) -> float:
    return float(v.item()) if torch.is_tensor(v) else float(v)
