"""When the control loops exchange their measurements: every iteration while anything changes,
further apart while nothing does.

The boundary's exchange (``runtime.boundary``: a barrier and one all-gather) costs the same on a
small model as on a large one, a few milliseconds on gloo, so on a short iteration it is what the
control loops cost. While no loop acts and no loop is on its way to acting (a detector's count of
slow iterations at zero, a search beside training settled), the gap to the next exchange doubles,
1, 2, 4, ... up to ``max_gap`` iterations; anything else brings it back to 1. So the iterations a
detector counts in a row are consecutive iterations, as when every iteration exchanges: a streak
starts only at an exchange, and the next exchange is then the next iteration. A change that starts
between two exchanges is seen at the next one: at most ``max_gap - 1`` iterations later than with
an exchange every iteration (8 at ~100 ms per iteration: under a second). A loop that acts only at
some iterations (the link detector with ``adapt.every_iterations`` k > 1 runs every k-th) names the
next one (``due_by``) and gets an exchange there, so it runs at the iterations it would with an
exchange every iteration and decides at the same ones.

Every rank must agree on whether an iteration ends with an exchange (a rank inside the collective
waits for one that is not, which waits for the first one's next message: a deadlock), so the next
exchange follows from what every rank holds alike after the last one: the gathered table and the
loops' state fed by it, never a local clock.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

MAX_GAP = 8  # iterations between exchanges at most, by default: ~0.8 s of reaction at 100 ms per iteration


@dataclass
class ExchangeSchedule:
    """The gap rule: ``due(i)`` says whether iteration ``i`` ends with an exchange; after one,
    ``exchanged(i, quiet)`` sets the next."""

    max_gap: int = MAX_GAP
    gap: int = 1
    next: int = 0  # the next iteration that ends with an exchange

    def __post_init__(self):
        if self.max_gap < 1:
            raise ValueError(f"max_gap must be >= 1, not {self.max_gap}")

    def due(self, iteration: int) -> bool:
        return iteration >= self.next

    def exchanged(self, iteration: int, quiet: bool, due_by: Optional[int] = None) -> None:
        """Iteration ``iteration`` ended with an exchange after which the loops said ``quiet``;
        ``due_by``: the earliest iteration a loop needs the next exchange at (a detector that runs
        every k iterations), if before the gap rule's."""
        self.gap = min(2 * self.gap, self.max_gap) if quiet else 1
        self.next = iteration + self.gap
        if due_by is not None and iteration < due_by < self.next:
            self.next = due_by


def exchange_iterations(iterations: int, quiet: Callable[[int], bool], max_gap: int = MAX_GAP,
                        due_by: Callable[[int], Optional[int]] = lambda i: None) -> list[int]:
    """Which of the first ``iterations`` iterations (0-based) end with an exchange, when the loops say
    ``quiet(i)`` and ``due_by(i)`` after the exchange at iteration ``i``."""
    schedule, out = ExchangeSchedule(max_gap), []
    for i in range(iterations):
        if schedule.due(i):
            out.append(i)
            schedule.exchanged(i, quiet(i), due_by(i))
    return out
