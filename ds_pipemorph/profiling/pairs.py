"""Pairs of ranks for ``pipemorph profile-links --all-pairs``: the round-robin schedule that measures
every pair once, and the testing-only ``--inject-pairs-ms`` option.

Schedule: a round-robin tournament (the circle method). With W ranks there are W − 1 rounds of W/2
disjoint pairs (W even) or W rounds of (W − 1)/2 pairs with one rank sitting out (W odd); every pair
of ranks meets in exactly one round, and the pairs of a round are measured at the same time, since
no rank is in two of them.

Pure Python: no torch.
"""
from __future__ import annotations

import re
from typing import Optional

from ..fileio import BadInput

Pair = tuple[int, int]  # (a, b) with a < b


def round_robin(world: int) -> list[list[Pair]]:
    """The rounds of a round-robin tournament of ``world`` ranks; each pair is ``(a, b)`` with a < b,
    each round sorted. Fixed rank 0 (or the bye of an odd ``world``), the others rotate."""
    if world < 2:
        return []
    bye = world if world % 2 else None  # a phantom rank: whoever meets it sits out that round
    players = list(range(world)) + ([bye] if bye is not None else [])
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if bye not in (a, b):
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def partner(round_pairs: list[Pair], rank: int) -> Optional[Pair]:
    """The pair of ``round_pairs`` that ``rank`` is in (None: it sits out)."""
    for p in round_pairs:
        if rank in p:
            return p
    return None


_ITEM = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*:\s*([-+]?[0-9.]+(?:[eE][-+]?\d+)?)\s*")
OPTION = "--inject-pairs-ms"


def parse_pair_delays(text: Optional[str]) -> Optional[dict[Pair, float]]:
    """``0-2:30,1-3:5`` -> ``{(0, 2): 30.0, (1, 3): 5.0}`` (a pair written either way round is one link).

    Checks the form only; ``check_pair_ranks`` checks the ranks against the world size."""
    if text is None:
        return None
    out: dict[Pair, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        m = _ITEM.fullmatch(item)
        try:
            ms = float(m.group(3)) if m else None
        except ValueError:
            ms = None
        if ms is None:
            raise BadInput(f"{OPTION}: '{item.strip()}' is not RANK-RANK:MS (e.g. 0-2:30)")
        a, b = int(m.group(1)), int(m.group(2))
        if ms < 0 or ms != ms or ms == float("inf"):
            raise BadInput(f"{OPTION}: '{item.strip()}' has a delay of {ms} ms; a delay is a finite number >= 0")
        if a == b:
            raise BadInput(f"{OPTION}: '{item.strip()}' joins rank {a} with itself, not a link")
        key = (min(a, b), max(a, b))
        if key in out:
            raise BadInput(f"{OPTION}: the pair {key[0]}-{key[1]} is given twice ({a}-{b} and {b}-{a} are one link)")
        out[key] = ms
    if not out:
        raise BadInput(f"{OPTION}: '{text}' names no pair; write RANK-RANK:MS, e.g. 0-2:30")
    return out


def check_pair_ranks(delays: dict[Pair, float], world: int) -> None:
    for a, b in delays:
        if b >= world:
            raise BadInput(f"{OPTION}: rank {b} of the pair {a}-{b} is outside 0..{world - 1} (this job has {world} ranks)")
