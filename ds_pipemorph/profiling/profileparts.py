"""Write one part of a profile (``links_ms`` or ``compute_ms``), alone or merged into an existing file.

A *profile part* is a YAML mapping with ``stages`` and some of the profile keys; a complete one
(``stages``, ``microbatches``, ``compute_ms``) is a profile that ``pipemorph plan`` reads. Merging
replaces one key of the raw mapping and keeps every other key as written; the result is validated
(with ``Profile`` when complete) before anything is written.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..fileio import BadInput, describe, dump, load_mapping
from ..plan.ir.profile import ComputeMs, Memory, Profile

ORDER = ("stages", "microbatches", "compute_ms", "links_ms", "memory")


class ProfilePart(BaseModel):
    """The keys of a profile, every one but ``stages`` optional."""

    model_config = ConfigDict(extra="forbid")
    stages: int = Field(ge=1)
    microbatches: Optional[int] = Field(None, ge=1)
    compute_ms: Optional[ComputeMs] = None
    links_ms: Optional[list[float]] = None
    memory: Optional[Memory] = None


def is_complete(data: dict) -> bool:
    return all(k in data for k in ("stages", "microbatches", "compute_ms"))


def validate(data: dict, source: str) -> None:
    """Refuse a part or profile that ``Profile`` (complete) or ``ProfilePart`` would refuse."""
    try:
        if is_complete(data):
            Profile.model_validate(data)
        else:
            part = ProfilePart.model_validate(data)
            n = part.stages
            if part.links_ms is not None and len(part.links_ms) != n - 1:
                raise BadInput(f"{source}: links_ms: expected {n - 1} values (one per link between {n} stages), "
                               f"got {len(part.links_ms)}")
            if part.compute_ms is not None:  # per-stage lengths, as Profile checks them
                Profile.model_validate({"stages": n, "microbatches": 1, "compute_ms": data["compute_ms"]})
    except ValidationError as e:
        raise BadInput(f"{source}: {describe(e)}") from None


def load_base(path: str, stages: int, who: str) -> dict:
    """The raw mapping of ``--merge PATH``, validated, with as many stages as this job has."""
    data = load_mapping(path)
    validate(data, str(path))
    if data["stages"] != stages:
        raise BadInput(f"--merge {path}: the profile has {data['stages']} stages, {who} has {stages}")
    return data


def merged(base: Optional[dict], stages: int, **parts) -> dict:
    """``base`` (or a new part) with ``parts`` replaced, keys in the contract's order."""
    data = dict(base) if base is not None else {"stages": stages}
    for k, v in parts.items():
        if v is not None:
            data[k] = v
    order = [k for k in ORDER if k in data] + [k for k in data if k not in ORDER]
    out = {k: data[k] for k in order}
    validate(out, "the merged profile")
    return out


def render(data: dict, path: str) -> str:
    return dump(data, str(path).lower().endswith(".json"))
