"""One pipeline job in the network lab: each lab node runs one rank (one stage) under its own
``torchrun --nnodes N --node_rank k``, as on a cluster; the lab benchmarks and the failover test use it.

The job trains one of two models (``JobSpec.model``):

- ``emulated`` (4 nodes): the emulated pipeline of ``pipemorph bench`` (``inject.emulated.EmulatedStage``:
  F, B and W take fixed times around tiny real math), fed with micro-batches of ``rows`` x 8 float32
  values, so every activation and every input gradient that crosses a link is ``32 * rows`` real
  bytes (the bench itself sends 1 x 8 values, 32 bytes);
- ``gpt`` (2 nodes, one intra-op thread each): the GPT recipe's model (``recipes/gpt/model.py``: tied
  embedding, 4 blocks, d = 128, 64-byte windows) cut by its blocks, on windows of the recipe's own
  data (``recipes/gpt/data.py``), ``gpt_batch`` windows per micro-batch: every message is
  ``gpt_batch * 64 * 128`` float32 values and every op is real compute that competes for the cores.

One job runs several rows (engine settings) one after the
other, each on a fresh engine; per iteration it records the time from a barrier to the last rank's
return from ``train_batch``, every rank's time in sends, receives, ``WaitSends`` and compute (from the
engine's op records), the link-delay estimator's reading (``control.estimate.link_delays`` on the
same records, as the control loop computes it; the control loop's own reading too when it runs) and
the path of every link. Rank 0 writes the results as JSON; each rank can save its stage's parameters.

    python benchmarks/_common/_lab_job.py SPEC.json      (the rank side: torchrun starts it in each node)

The launcher side is ``run_job(lab, spec, work)``: it starts one torchrun per node inside the lab's
nodes, follows the progress file (rank 0 appends one JSON line per iteration, outside the timed span)
and hands each new line to ``on_progress`` (which may, e.g., take an interface down), and returns
every node's exit code and log with the results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # after PYTHONPATH: a package earlier on the path is the one the job runs
    sys.path.append(str(REPO))

NODES = 4  # the emulated model's stages
GPT_NODES = 2  # the GPT model's stages: one rank per core of a 2-core machine
GPT_SEQ, GPT_D_MODEL = 64, 128  # the recipe's window and width (gpt()'s max_seq and d_model defaults)
WIDTH = 8  # EmulatedStage's width: an activation is rows x WIDTH float32 values
BYTES_PER_ROW = 4 * WIDTH


def rows_for(seconds: float, rate_bits: int) -> int:
    """Rows per micro-batch so that one activation takes ``seconds`` on a link of ``rate_bits``:
    8 S / R = seconds with S = 32 rows bytes."""
    return max(1, round(seconds * rate_bits / 8 / BYTES_PER_ROW))


def add_link_options(ap, iterations: int, warmup: int, out: str) -> None:
    """The options of the lab benchmarks that run rows on one shaped link: its rate, the message's
    wire time there, the emulated stage, iterations per row and the output."""
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--message-ms", type=float, default=40.0, help="8 S / R of one activation on the shaped link")
    ap.add_argument("--op-ms", type=float, default=20.0)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=iterations, help="measured iterations per row")
    ap.add_argument("--warmup", type=int, default=warmup, help="unmeasured iterations per row")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="the engine's timeout_s")
    ap.add_argument("--out", default=out)


class Row(BaseModel):
    """One engine run of the job: its ``pipemorph`` section (or DeepSpeed's own engine, ``stock``),
    how many iterations it trains, and the link setting it runs under: when ``setting`` is given, rank
    0 hands it to the launcher (``run_job``'s ``on_setting``) before the row's engine is built and
    every rank waits until the launcher has applied it."""

    model_config = ConfigDict(extra="forbid")
    name: str
    pipemorph: dict = Field(default_factory=dict)
    iterations: int = Field(ge=1)
    stock: bool = False  # DeepSpeed's PipelineEngine and its 1F1B TrainSchedule; ``pipemorph`` unused
    setting: Optional[str] = None


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: list[Row] = Field(min_length=1)
    model: Literal["emulated", "gpt"] = "emulated"
    gpt_batch: int = Field(default=4, ge=1)  # windows per micro-batch of the gpt model
    microbatches: int = Field(ge=1)
    op_ms: float = Field(gt=0)
    act_rows: int = Field(ge=1)  # rows per micro-batch: 32 * act_rows bytes per message
    timeout_s: float = Field(gt=0)  # the engine's (pipemorph.timeout_s) and the process group's
    out: str
    progress: str
    params_dir: Optional[str] = None  # each rank saves stage<k>.pt (the last row's parameters) here

    @property
    def nodes(self) -> int:
        return GPT_NODES if self.model == "gpt" else NODES

    @property
    def message_bytes(self) -> int:
        if self.model == "gpt":
            return gpt_message_bytes(self.gpt_batch)
        return BYTES_PER_ROW * self.act_rows


def gpt_message_bytes(batch: int) -> int:
    """One activation (or input gradient) of the gpt model between its two stages: float32 vectors
    of d_model values for every byte of ``batch`` windows."""
    return 4 * batch * GPT_SEQ * GPT_D_MODEL


# --------------------------------------------------------------------------------------------------
# rank side


def _gpt_recipe():
    """The GPT recipe's ``model`` and ``data`` modules (the recipe is a folder of scripts, not a package)."""
    recipe = str(REPO / "recipes" / "gpt")
    if recipe not in sys.path:
        sys.path.insert(0, recipe)
    import data
    import model

    return model, data


def _module(spec: JobSpec):
    """The job's PipelineModule, the same parameters on every row (seeded)."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from ds_pipemorph.inject.emulated import EmulatedStage

    torch.manual_seed(0)
    if spec.model == "gpt":
        model, data = _gpt_recipe()
        return model.gpt(vocab=data.VOCAB, stages=GPT_NODES, d_model=GPT_D_MODEL, max_seq=GPT_SEQ)
    t = spec.op_ms
    return PipelineModule(layers=[LayerSpec(EmulatedStage, WIDTH, t, t, t) for _ in range(NODES)],
                          num_stages=NODES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")


def _data(spec: JobSpec) -> list:
    """One iteration's micro-batches, equal on every rank and every row."""
    import torch

    if spec.model == "gpt":
        _, data = _gpt_recipe()
        return data.micro_batches("train", GPT_SEQ, spec.gpt_batch, spec.microbatches)
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, spec.act_rows, WIDTH, generator=g), torch.randn(1, spec.act_rows, WIDTH, generator=g))
            for _ in range(spec.microbatches)]


def _build(spec: JobSpec, row: Row):
    import deepspeed

    import ds_pipemorph
    from ds_pipemorph.inject.emulated import anchor_stock_engine

    model = _module(spec)
    mbs = spec.gpt_batch if spec.model == "gpt" else 1
    optimizer = ({"type": "Adam", "params": {"lr": 1e-3}} if spec.model == "gpt"  # the recipe's
                 else {"type": "SGD", "params": {"lr": 1e-1}})
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": spec.microbatches,
           "train_batch_size": mbs * spec.microbatches, "optimizer": optimizer, "steps_per_print": 10**9}
    if row.stock:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if spec.model == "emulated":
            anchor_stock_engine(engine)  # emulated ops count from the instruction's start, as in ours
        return engine
    cfg["pipemorph"] = {"nvtx": False, "timeout_s": spec.timeout_s, **row.pipemorph}
    engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _apply_setting(spec: JobSpec, row: Row, index: int) -> None:
    """Rank 0 asks the launcher for the row's link setting and waits for its acknowledgement; then
    every rank passes a barrier, so no rank builds the row's engine under the previous setting."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(spec.progress, "a") as f:
            f.write(json.dumps({"row": index, "name": row.name, "setting": row.setting}) + "\n")
        ack = Path(f"{spec.progress}.ack{index}")
        deadline = time.monotonic() + spec.timeout_s
        while not ack.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the launcher did not apply link setting '{row.setting}' within {spec.timeout_s:g} s")
            time.sleep(0.05)
    dist.barrier()


def _op_sums(records) -> dict:
    """ms per iteration in sends, receives, WaitSends and F/B/W on this rank (all three, and each),
    from its op records."""
    out = {"send_ms": 0.0, "recv_ms": 0.0, "wait_sends_ms": 0.0, "compute_ms": 0.0, "max_send_ms": 0.0,
           "F_ms": 0.0, "B_ms": 0.0, "W_ms": 0.0}
    for r in records:
        ms = (r.end_ns - r.start_ns) / 1e6
        if r.op.startswith("SEND_"):
            out["send_ms"] += ms
            out["max_send_ms"] = max(out["max_send_ms"], ms)
        elif r.op.startswith("RECV_"):
            out["recv_ms"] += ms
        elif r.op == "WaitSends":
            out["wait_sends_ms"] += ms
        elif r.op[:1] in "FBW" and r.op[1:].isdigit():
            out["compute_ms"] += ms
            out[f"{r.op[0]}_ms"] += ms
    return {k: round(v, 3) for k, v in out.items()}


def _link_modes(engine, nodes: int) -> list[str]:
    t = getattr(engine, "transport", None)
    if t is None:  # DeepSpeed's own engine: its p2p sends on the training process's group
        return ["stock"] * (nodes - 1)
    return [t.link_mode(i) for i in range(nodes - 1)]


def _fifos(engine, modes: list[str]) -> list:
    """Per link, what the link-delay estimator needs, as the control loop gives it: a delegated link's
    queues; 1 for a direct link whose sends do not block (gloo's isend: one FIFO); None otherwise."""
    if getattr(engine, "adapter", None) is not None:  # the control loop's own, per link
        return engine.adapter.policy.fifos()
    from ds_pipemorph.runtime.transport.protocol import sender_waits_on

    direct = engine.transport.direct
    return [engine.transport.queues_of(k) if m == "delegated" else (None if sender_waits_on(direct, k) else 1)
            for k, m in enumerate(modes)]


def _run_row(spec: JobSpec, row: Row, index: int, data) -> dict:
    import torch
    import torch.distributed as dist

    from ds_pipemorph.control.estimate import Neighbours, RankTimes, link_delays, message_times

    rank, nodes = dist.get_rank(), spec.nodes
    if row.setting is not None:
        _apply_setting(spec, row, index)
    engine = _build(spec, row)
    records = (lambda: engine.op_records) if not row.stock else (lambda: [])
    iters = []
    for i in range(row.iterations):
        dist.barrier()
        t0 = time.monotonic_ns()
        loss = engine.train_batch(iter(data))
        span = torch.tensor([-t0, time.monotonic_ns()], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        # Outside the timed span: every rank's op sums, message times and link paths.
        mine = {"ops": _op_sums(records()), "modes": _link_modes(engine, nodes),
                "times": None if row.stock else message_times(records(), spec.microbatches, engine.stage_id, {})}
        everyone = [None] * nodes
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            modes = [everyone[k]["modes"][k] for k in range(nodes - 1)]  # rank k is an end of link k
            it = {"iteration": i, "start_s": -span[0].item() / 1e9, "ms": (span[0].item() + span[1].item()) / 1e6,
                  "loss": float(loss) if loss is not None else None,
                  "ops": [e["ops"] for e in everyone], "modes": modes, "estimated_links_ms": None}
            if not row.stock:  # the estimator reads our engine's op records; the stock engine keeps none
                fifos = _fifos(engine, modes)
                rows = {r: RankTimes(r, Neighbours(r - 1 if r > 0 else None, r + 1 if r < nodes - 1 else None),
                                     e["times"])
                        for r, e in enumerate(everyone)}
                it["estimated_links_ms"] = link_delays(rows, nodes - 1, spec.microbatches, fifos)
            adapter = getattr(engine, "adapter", None)
            if adapter is not None and adapter.measured:
                it["adapter_links_ms"] = adapter.measured[-1]
            iters.append(it)
            with open(spec.progress, "a") as f:
                f.write(json.dumps({"row": index, "name": row.name, "iteration": i, "ms": it["ms"],
                                    "time": time.monotonic()}) + "\n")
    adapter = getattr(engine, "adapter", None)
    replans = [{"iteration": r.iteration, "kind": r.kind, "measured_ms": r.measured_ms, "target_ms": r.target_ms,
                "warmup": r.warmup, "predicted_ms": r.predicted_ms} for r in adapter.replans] if adapter else []
    transport = getattr(engine, "transport", None)
    events = (list(getattr(transport, "events", [])) + list(getattr(getattr(transport, "delegated", None), "events", [])))
    all_events = [None] * nodes
    dist.all_gather_object(all_events, events)
    switch = [None] * nodes  # per rank: (iteration, ms) spent moving links between transports after a re-plan
    dist.all_gather_object(switch, list(getattr(engine, "switch_ms", [])))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    dist.barrier()
    return {"name": row.name, "pipemorph": row.pipemorph, "iterations": iters, "replans": replans,
            "events": [e for ev in all_events for e in ev], "switch_ms": switch, "params": params}


def main(spec_path: str) -> None:
    from datetime import timedelta

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_pipemorph.fileio import load_model, write_atomic

    spec = load_model(spec_path, JobSpec)
    torch.set_num_threads(1)  # one intra-op thread per rank (OMP_NUM_THREADS=1 too): real ops share no core
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=spec.timeout_s))
    rank = dist.get_rank()
    data = _data(spec)
    results = []
    for k, row in enumerate(spec.rows):
        res = _run_row(spec, row, k, data)
        params = res.pop("params")
        results.append(res)
    if spec.params_dir:
        Path(spec.params_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"stage": rank, "params": params}, Path(spec.params_dir) / f"stage{rank}.pt")
    if rank == 0:
        write_atomic(spec.out, json.dumps({"spec": spec.model_dump(), "rows": results}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# launcher side


@dataclass
class JobResult:
    codes: list  # exit code per node ("timeout" if it was killed)
    logs: list[str]  # each node's output
    results: Optional[dict]  # rank 0's JSON, None when the job did not write it
    seconds: float
    progress: list[dict] = field(default_factory=list)

    def log_text(self) -> str:
        return "\n".join(f"--- node {k} (exit {c})\n{t}" for k, (c, t) in enumerate(zip(self.codes, self.logs)))


def read_progress(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(ln) for ln in text.split("\n")[:-1] if ln.strip()]


def node_command(lab, k: int, spec_path: Path, net: int, port: int, nodes: int = NODES) -> list[str]:
    from ds_pipemorph.procs import torchrun

    return [*torchrun(spec_path.parent / f"torchrun{k}", "--nnodes", str(nodes), "--nproc_per_node", "1"),
            "--node_rank", str(k), "--master_addr", lab.addr(0, net), "--master_port", str(port),
            str(Path(__file__).resolve()), str(spec_path)]


def stop_nodes(procs) -> list:
    """Every node's exit code; a node still running is killed with its process group ("timeout")."""
    from ds_pipemorph.procs import kill_group

    codes: list = []
    for p in procs:
        if p.poll() is None:
            kill_group(p)
            p.wait()
            codes.append("timeout")
        else:
            codes.append(p.returncode)
    return codes


def run_job(lab, spec: JobSpec, work: Path, net: int = 0, port: int = 29631, timeout_s: float = 1200.0,
            on_progress: Callable[[list[dict]], None] = lambda lines: None,
            on_setting: Callable[[int, str], None] = lambda row, setting: None) -> JobResult:
    """Run ``spec`` on the lab's nodes 0..``spec.nodes`` - 1, the ranks' own process group on network ``net`` (its
    interface as GLOO_SOCKET_IFNAME, node 0's address on it as the master); ``on_progress`` gets the
    iteration lines so far whenever a new one arrives; ``on_setting(row, setting)`` applies a row's
    link setting before that row starts (the job waits for it). A job still running after
    ``timeout_s`` is killed."""
    from ds_pipemorph.procs import versioned_extensions_dir

    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    progress = Path(spec.progress)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": lab.ifname(net),
           "PYTHONPATH": os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p]),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())}
    logs = [work / f"node{k}.log" for k in range(spec.nodes)]
    procs = []
    t0 = time.monotonic()
    for k in range(spec.nodes):
        with open(logs[k], "w") as log:
            procs.append(lab.popen(k, node_command(lab, k, spec_path, net, port, spec.nodes), env=env, stdout=log,
                                   stderr=subprocess.STDOUT, cwd=str(REPO)))
    seen = 0
    try:
        while any(p.poll() is None for p in procs):
            lines = read_progress(progress)
            if len(lines) > seen:
                for ln in lines[seen:]:
                    if "setting" in ln:
                        on_setting(ln["row"], ln["setting"])
                        Path(f"{progress}.ack{ln['row']}").touch()
                seen = len(lines)
                iterations = [ln for ln in lines if "setting" not in ln]
                if iterations:
                    on_progress(iterations)
            if time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.2)
    finally:
        codes = stop_nodes(procs)
    out = Path(spec.out)
    results = json.loads(out.read_text()) if out.exists() else None
    return JobResult(codes, [p.read_text(errors="replace") for p in logs], results, time.monotonic() - t0,
                     [ln for ln in read_progress(progress) if "setting" not in ln])


if __name__ == "__main__":
    main(sys.argv[1])
