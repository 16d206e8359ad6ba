"""The control loop's modes, each defined once: the config's fields are these ``Literal`` types, and
a public function that takes a mode as a string checks it against the matching tuple (the re-plan
mode reaches only the adapter, which the engine builds from a validated config: it has none).

Pure Python, imports nothing: the config module (imported by ``import ds_pipemorph``) reads it.
"""
from __future__ import annotations

from typing import Literal, get_args

# How links are routed: "off" every link direct, "always" every link through the delegates, "auto"
# the links planned for a delay through the delegates (``control.policy``).
DelegationMode = Literal["off", "auto", "always"]
DELEGATION_MODES: tuple[str, ...] = get_args(DelegationMode)

# Where a re-plan's search runs: "background" beside training after a closed-form first reaction,
# "inline" at the boundary while every rank waits (``runtime.adapt``).
ReplanMode = Literal["background", "inline"]
