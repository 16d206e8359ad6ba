"""What one ``pipemorph paired`` run compares: two sides, the pipeline, and how they alternate.

A side is written ``PLAN[+MODIFIER...]``: PLAN is ``zb``, ``1f1b`` or ``plan:FILE`` (this
package's engine with that plan), ``stock-1f1b`` (DeepSpeed's own engine) or ``pipemorph`` (the
adaptive schedule with its control loop); modifiers are ``ordered``/``ready`` (dispatch),
``direct``/``delegated`` (every link's transport) and ``recvN`` (``recv_window`` N). Sides of this package's engine with a fixed plan
share one job and switch at every iteration boundary; a side with another engine or a control loop
of its own cannot, and then whole short jobs alternate. Errors are one sentence naming the option.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..fileio import BadInput
from ..plan.ir.lower import Dispatch

PLANS = ("zb", "1f1b", "stock-1f1b", "pipemorph")
MODIFIERS = {"ordered": ("dispatch", "ordered"), "ready": ("dispatch", "ready"),
             "direct": ("delegated", False), "delegated": ("delegated", True)}
RECV_WINDOW = re.compile(r"recv([0-9]{1,6})")  # recvN: ``recv_window`` N (N >= 1)
OWN_JOB = ("stock-1f1b", "pipemorph")  # cannot switch inside a job of the other side


class Side(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str
    plan: str  # one of PLANS, or "plan" with plan_file
    plan_file: Optional[str] = None
    dispatch: Dispatch = Dispatch.ORDERED
    delegated: bool = False
    recv_window: Optional[int] = None  # None: the config's default

    def section(self, budget: Optional[float] = 1.0) -> dict:
        """The ds_config ``pipemorph`` section of this side (fixed plans: no control loop) under the
        run's ``memory.budget``."""
        out = {"schedule": self.plan, "dispatch": self.dispatch, "adapt": {"enabled": False},
               "delegation": {"mode": "always" if self.delegated else "off"}, "nvtx": False,
               "memory": {"budget": budget}}
        if self.plan_file:
            out["plan_file"] = self.plan_file
        if self.recv_window is not None:
            out["recv_window"] = self.recv_window
        return out

    def bench_row(self) -> tuple[str, Dispatch]:
        """(schedule, dispatch) of ``pipemorph bench``'s worker for a whole job of this side."""
        if self.plan == "stock-1f1b":
            return "stock-1f1b", Dispatch.ORDERED
        if self.plan == "pipemorph":
            return "pipemorph", self.dispatch
        return ("zb-delegated" if self.delegated else "zb"), self.dispatch


def parse_side(text: str, option: str) -> Side:
    """``zb+ready``, ``1f1b``, ``plan:out/p.yaml+delegated``, ``stock-1f1b`` ... as a ``Side``."""
    head, *mods = [t.strip() for t in text.strip().split("+")]
    fields: dict = {"text": text.strip()}
    if head.startswith("plan:"):
        path = head[len("plan:"):]
        if not Path(path).is_file():
            raise BadInput(f"{option}: cannot read the plan file '{path}'")
        fields.update(plan="plan", plan_file=str(Path(path).resolve()))
    elif head in PLANS:
        fields["plan"] = head
    else:
        raise BadInput(f"{option}: '{head}' is not a plan: choose from {', '.join(PLANS)} or plan:FILE")
    for m in mods:
        window = RECV_WINDOW.fullmatch(m)
        if window:
            key, value = "recv_window", int(window.group(1))
            if window.group(1).startswith("0"):  # recv0, recv01: N >= 1, written plainly
                raise BadInput(f"{option}: '{m}' in '{text}': recvN takes a whole number N >= 1 (e.g. recv2)")
        elif m in MODIFIERS:
            key, value = MODIFIERS[m]
        else:
            raise BadInput(f"{option}: unknown modifier '{m}' in '{text}': choose from {', '.join(MODIFIERS)} "
                           f"or recvN (N receives of each kind posted ahead, e.g. recv2)")
        if key in fields and key != "text":
            raise BadInput(f"{option}: '{text}' sets the {key} twice")
        fields[key] = value
    side = Side(**fields)
    if side.plan == "stock-1f1b" and (side.dispatch is not Dispatch.ORDERED or side.delegated):
        raise BadInput(f"{option}: stock-1f1b runs DeepSpeed's own engine: drop '+ready' and '+delegated'")
    if side.recv_window is not None:
        if side.plan in OWN_JOB or side.plan == "plan":
            why = {"plan": "a plan file names its own", "stock-1f1b": "stock-1f1b is DeepSpeed's own engine",
                   "pipemorph": "pipemorph runs its own control loop in whole jobs"}[side.plan]
            raise BadInput(f"{option}: '+recv{side.recv_window}' sets the receive window of this package's zb and "
                           f"1f1b sides only ({why})")
        if side.dispatch is Dispatch.READY:
            raise BadInput(f"{option}: '+recv{side.recv_window}' applies to ordered dispatch (ready dispatch posts "
                           f"every receive up front): drop '+ready' or '+recv{side.recv_window}'")
    if side.plan == "pipemorph" and "delegated" in fields:
        raise BadInput(f"{option}: pipemorph chooses each link's transport itself: drop '+direct'/'+delegated'")
    return side


def share_a_job(a: Side, b: Side) -> bool:
    """Whether A and B can alternate inside one job (this package's engine, fixed plans)."""
    return a.plan not in OWN_JOB and b.plan not in OWN_JOB


def check_job_sides(a: Side, b: Side) -> None:
    """Whole-job alternation runs ``pipemorph bench``'s rows: ``zb`` (direct or delegated),
    ``stock-1f1b`` and ``pipemorph``."""
    for opt, side in (("A", a), ("B", b)):
        if side.recv_window is not None:
            raise BadInput(f"{opt}: '{side.text}' cannot be run in whole alternating jobs (pipemorph bench's rows "
                           f"post receives with the default window); compare it with a side of this engine instead")
        if side.plan in ("1f1b", "plan"):
            raise BadInput(f"{opt}: '{side.text}' cannot be run in whole alternating jobs (only zb, stock-1f1b "
                           f"and pipemorph can, as pipemorph bench runs them); compare it with a side of this "
                           f"engine instead")


class PairedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: Side
    b: Side
    stages: int = Field(ge=2)
    microbatches: int = Field(ge=1)
    op_ms: float = Field(gt=0)
    links_ms: list[float]
    cycles: int = Field(ge=1)  # of A B A' B: two B/A pairs and one A/A pair each
    warmup: int = Field(ge=0)  # iterations (one job) or each job's own unmeasured iterations (whole jobs)
    job_iterations: int = Field(5, ge=1)  # whole jobs: measured iterations of each (its sample: their median)
    seed: int = 0
    out: str
    progress_file: str
    record_ops: bool = True  # one job: every rank's F/B/W order per iteration goes into the JSON
    budget: Optional[float] = 1.0  # the engine's memory.budget, both sides (None: no limit)

    @model_validator(mode="after")
    def _shapes(self) -> "PairedSpec":
        if len(self.links_ms) != self.stages - 1:
            raise ValueError(f"--links-ms: {len(self.links_ms)} delays for {self.stages - 1} links")
        if any(c < 0 for c in self.links_ms):
            raise ValueError("--links-ms: delays must be >= 0 ms")
        return self

    @property
    def one_job(self) -> bool:
        return share_a_job(self.a, self.b)

    @property
    def iterations(self) -> int:
        """One job: every iteration, warm-up included; whole jobs: the number of jobs."""
        n = 4 * self.cycles
        return self.warmup + n if self.one_job else n
